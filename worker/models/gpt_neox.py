"""GPTNeoXForCausalLM: partial rotary, fused per-head QKV, parallel or sequential residual."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.worker.layers.activation import get_act_fn
from pagedserve.worker.layers.attention import Attention
from pagedserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.worker.layers.linear import ColumnParallelLinear, RowParallelLinear, divide
from pagedserve.worker.layers.rotary import rope_from_config
from pagedserve.worker.models.utils import load_params
from pagedserve.worker.parallel_state import get_tp_size


class GPTNeoXLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = h // heads
        self.num_heads = divide(heads, get_tp_size(), "number of attention heads")
        bias = getattr(config, "attention_bias", True)
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        # The checkpoint lays QKV out as [heads, 3, head_dim], so a contiguous row shard is whole heads.
        self.query_key_value = ColumnParallelLinear(h, 3 * h, bias=bias)
        self.dense = RowParallelLinear(h, h, bias=bias)
        self.rotary_emb = rope_from_config(config, self.head_dim)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_heads)
        self.dense_h_to_4h = ColumnParallelLinear(h, config.intermediate_size, bias=True)
        self.dense_4h_to_h = RowParallelLinear(config.intermediate_size, h, bias=True)
        self.act = get_act_fn(config.hidden_act)

    def _attention(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.query_key_value(x).view(-1, self.num_heads, 3, self.head_dim)
        q, k = self.rotary_emb(positions, qkv[:, :, 0], qkv[:, :, 1])
        return self.dense(self.attn(q, k, qkv[:, :, 2]))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        attn = self._attention(positions, self.input_layernorm(x))
        if self.use_parallel_residual:
            mlp = self.dense_4h_to_h(self.act(self.dense_h_to_4h(self.post_attention_layernorm(x))))
            return x + attn + mlp
        x = x + attn
        return x + self.dense_4h_to_h(self.act(self.dense_h_to_4h(self.post_attention_layernorm(x))))


class GPTNeoXForCausalLM(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_in = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GPTNeoXLayer(config) for _ in range(config.num_hidden_layers))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.embed_out = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.embed_out.tie_to(self.embed_in)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_in(input_ids)
        for layer in self.layers:
            x = layer(positions, x)
        return self.final_layer_norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.embed_out.compute_logits(hidden_states)

    def load_weights(self, weights) -> None:
        def rename(name: str) -> str | None:
            name = name.removeprefix("gpt_neox.")
            if name.endswith((".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")):
                return None
            if self.tie_word_embeddings and name == "embed_out.weight":
                return None
            for part in ("query_key_value", "dense"):
                name = name.replace(f".attention.{part}.", f".{part}.")
            return name.replace(".mlp.", ".")

        load_params(self, weights, rename=rename)
