"""GPT2LMHeadModel: learned positions, Conv1D checkpoints ([in, out] weights), fused c_attn."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.worker.layers.activation import get_act_fn
from pagedserve.worker.layers.attention import Attention
from pagedserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.worker.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedserve.worker.models.utils import load_params
from pagedserve.worker.models.weights import as_lazy


class GPT2Block(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        head_dim = h // heads
        inner = config.n_inner or 4 * h
        self.ln_1 = nn.LayerNorm(h, eps=config.layer_norm_epsilon)
        self.c_attn = QKVParallelLinear(h, head_dim, heads, heads, bias=True)
        self.c_proj = RowParallelLinear(h, h, bias=True)
        scale = head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= layer_idx + 1
        self.attn = Attention(self.c_attn.num_heads, head_dim, scale, self.c_attn.num_kv_heads)
        self.ln_2 = nn.LayerNorm(h, eps=config.layer_norm_epsilon)
        self.c_fc = ColumnParallelLinear(h, inner, bias=True)
        self.mlp_proj = RowParallelLinear(inner, h, bias=True)
        self.act = get_act_fn(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.c_attn
        q, k, v = p(self.ln_1(x)).split([p.q_size, p.kv_size, p.kv_size], dim=-1)
        x = x + self.c_proj(self.attn(q, k, v))
        return x + self.mlp_proj(self.act(self.c_fc(self.ln_2(x))))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.lm_head.tie_to(self.wte)  # GPT-2 always ties

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights) -> None:
        def expand():
            for name, w in weights:
                name = name.removeprefix("transformer.")
                if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
                    continue
                name = name.replace(".attn.c_attn.", ".c_attn.").replace(".attn.c_proj.", ".c_proj.")
                name = name.replace(".mlp.c_fc.", ".c_fc.").replace(".mlp.c_proj.", ".mlp_proj.")
                w = as_lazy(w)
                conv1d = (".c_attn.", ".c_proj.", ".c_fc.", ".mlp_proj.")
                if name.endswith(".weight") and any(k in name for k in conv1d):
                    w = w.t()  # Conv1D stores [in, out]
                if ".c_attn." in name:
                    size = w.shape[0] // 3
                    yield from ((name.replace(".c_attn.", f".c_attn_{s}."), part)
                                for s, part in zip("qkv", w.chunk(0, [size] * 3)))
                else:
                    yield name, w

        load_params(self, expand(), [("c_attn", f"c_attn_{s}", s) for s in "qkv"])
