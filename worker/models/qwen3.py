"""Qwen3ForCausalLM: LLaMA with an RMSNorm over each head's query and key before rotary."""
from __future__ import annotations

import torch

from pagedserve.worker.layers.layernorm import RMSNorm
from pagedserve.worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, layer_idx: int) -> None:
        super().__init__(config, qkv_bias, o_bias, layer_idx)
        self.q_norm = RMSNorm(self.qkv_proj.head_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.qkv_proj.head_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        p = self.qkv_proj
        q, k, v = p(x).split([p.q_size, p.kv_size, p.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, p.head_size)).view(-1, p.num_heads, p.head_size)
        k = self.k_norm(k.reshape(-1, p.head_size)).view(-1, p.num_kv_heads, p.head_size)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    decoder_layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
