"""Gemma 2 and Gemma 3 (text): GeGLU, embeddings scaled by sqrt(hidden), (1 + weight) RMSNorms before and after
attention and MLP, alternating sliding-window and global layers, soft-capped logits; Gemma 3 adds per-head q/k norms
and a separate rope base on its sliding layers."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.common.config import AttentionShape
from pagedserve.worker.layers.activation import GeluAndMul
from pagedserve.worker.layers.attention import Attention, layer_sliding_window
from pagedserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.worker.layers.layernorm import GemmaRMSNorm
from pagedserve.worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedserve.worker.layers.rotary import rope_from_config
from pagedserve.worker.models.utils import load_params

_TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")


class GemmaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, qk_norm: bool) -> None:
        super().__init__()
        shape = AttentionShape.of(config)
        heads, kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_size
        bias = bool(getattr(config, "attention_bias", False))
        layer_types = getattr(config, "layer_types", None)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, heads, kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size, bias=bias)
        self.rotary_emb = rope_from_config(config, head_dim, layer_type=layer_types[layer_idx] if layer_types else None)
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, config.query_pre_attn_scalar**-0.5,
                              self.qkv_proj.num_kv_heads, sliding_window=layer_sliding_window(config, layer_idx),
                              logits_soft_cap=getattr(config, "attn_logit_softcapping", None))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        p = self.qkv_proj
        q, k, v = p(x).split([p.q_size, p.kv_size, p.kv_size], dim=-1)
        q, k = q.reshape(-1, p.num_heads, p.head_size), k.reshape(-1, p.num_kv_heads, p.head_size)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class GemmaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        if act not in (*_TANH_GELUS, "gelu"):
            raise ValueError(f"unsupported hidden_activation {act!r} for Gemma (gelu, gelu_pytorch_tanh)")
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=False)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=False)
        self.act_fn = GeluAndMul("tanh" if act in _TANH_GELUS else "none")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(config, layer_idx, qk_norm)
        self.mlp = GemmaMLP(config)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, config, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i, qk_norm) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to the model dtype first, as HF
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class Gemma2ForCausalLM(nn.Module):
    qk_norm = False
    stacked_params = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                      ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    def __init__(self, config) -> None:
        super().__init__()
        self.model = GemmaModel(config, self.qk_norm)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden_states)
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights) -> None:
        def rename(name: str) -> str | None:
            return None if self.tie_word_embeddings and name == "lm_head.weight" else name

        load_params(self, weights, self.stacked_params, rename)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
