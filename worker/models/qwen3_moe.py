"""Qwen3-MoE: Qwen3 attention (RMSNorm over each q and k head before rope) and, on the layers that
``decoder_sparse_step`` / ``mlp_only_layers`` pick, a sparse MoE block (no shared experts); the other layers keep a
dense SwiGLU MLP."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.worker.layers.layernorm import RMSNorm
from pagedserve.worker.layers.moe import SparseMoeBlock
from pagedserve.worker.models.llama import LlamaAttention, LlamaMLP
from pagedserve.worker.models.mixtral import MixtralDecoderLayer, MixtralForCausalLM, MixtralModel


class Qwen3MoeAttention(LlamaAttention):
    """LLaMA attention with per-head q/k RMSNorm; the same as dense Qwen3's, to be shared once both are in."""

    def __init__(self, config) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, qkv_bias=bias, o_bias=bias)
        self.q_norm = RMSNorm(self.qkv_proj.head_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.qkv_proj.head_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        p = self.qkv_proj
        q, k, v = self.qkv_proj(x).split([p.q_size, p.kv_size, p.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, p.head_size)).view(-1, p.num_heads, p.head_size)
        k = self.k_norm(k.reshape(-1, p.head_size)).view(-1, p.num_kv_heads, p.head_size)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


def is_moe_layer(config, layer_idx: int) -> bool:
    """HF's rule: experts on every ``decoder_sparse_step``-th layer, except those listed in ``mlp_only_layers``."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % step == 0)


class Qwen3MoeDecoderLayer(MixtralDecoderLayer):
    def make_attention(self, config) -> nn.Module:
        return Qwen3MoeAttention(config)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for Qwen3-MoE (silu only)")
        if not is_moe_layer(config, layer_idx):
            return LlamaMLP(config, bias=False)
        return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                              config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob),
                              round_weights=True)


class Qwen3MoeModel(MixtralModel):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    model_cls = Qwen3MoeModel
    expert_names = {}  # the checkpoint already names them gate_proj / up_proj / down_proj
