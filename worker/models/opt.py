"""OPTForCausalLM: learned positions with offset 2, optional project_in/out, pre- or post-LayerNorm."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.worker.layers.activation import get_act_fn
from pagedserve.worker.layers.attention import Attention
from pagedserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.worker.layers.linear import ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedserve.worker.models.utils import load_params

_POS_OFFSET = 2  # OPT reserves the first two rows of its position table


class OPTDecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        head_dim = h // heads
        bias, affine = config.enable_bias, config.layer_norm_elementwise_affine
        self.do_layer_norm_before = config.do_layer_norm_before
        self.qkv_proj = QKVParallelLinear(h, head_dim, heads, heads, bias=bias)
        self.out_proj = RowParallelLinear(h, h, bias=bias)
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, head_dim**-0.5, self.qkv_proj.num_kv_heads)
        self.self_attn_layer_norm = nn.LayerNorm(h, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(h, config.ffn_dim, bias=bias)
        self.fc2 = RowParallelLinear(config.ffn_dim, h, bias=bias)
        self.final_layer_norm = nn.LayerNorm(h, elementwise_affine=affine)
        self.act = get_act_fn(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        if self.do_layer_norm_before:
            x = self.self_attn_layer_norm(x)
        p = self.qkv_proj
        q, k, v = p(x).split([p.q_size, p.kv_size, p.kv_size], dim=-1)
        x = residual + self.out_proj(self.attn(q, k, v))
        if not self.do_layer_norm_before:
            x = self.self_attn_layer_norm(x)
        residual = x
        if self.do_layer_norm_before:
            x = self.final_layer_norm(x)
        x = residual + self.fc2(self.act(self.fc1(x)))
        return x if self.do_layer_norm_before else self.final_layer_norm(x)


class OPTForCausalLM(nn.Module):
    stacked_params = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v")]

    def __init__(self, config) -> None:
        super().__init__()
        h, proj = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + _POS_OFFSET, h)
        self.project_in = ReplicatedLinear(proj, h, bias=False) if proj != h else None
        self.project_out = ReplicatedLinear(h, proj, bias=False) if proj != h else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.final_layer_norm = None
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
            self.final_layer_norm = nn.LayerNorm(h, elementwise_affine=config.layer_norm_elementwise_affine)
        self.lm_head = ParallelLMHead(config.vocab_size, proj)
        self.lm_head.tie_to(self.embed_tokens)  # OPT ties the LM head to the input embedding

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + _POS_OFFSET)
        for layer in self.layers:
            x = layer(x)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        return self.project_out(x) if self.project_out is not None else x

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights) -> None:
        def rename(name: str) -> str | None:
            name = name.removeprefix("model.").removeprefix("decoder.")
            if name == "lm_head.weight":
                return None
            return name.replace(".self_attn.out_proj.", ".out_proj.").replace(".self_attn.", ".")

        load_params(self, weights, self.stacked_params, rename)
