"""LLaMA family: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.common.config import AttentionShape
from pagedserve.worker.layers.activation import SiluAndMul
from pagedserve.worker.layers.attention import Attention, layer_sliding_window
from pagedserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.worker.layers.layernorm import RMSNorm
from pagedserve.worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedserve.worker.layers.rotary import rope_from_config
from pagedserve.worker.models.utils import load_params


class LlamaAttention(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, layer_idx: int) -> None:
        super().__init__()
        shape = AttentionShape.of(config)
        heads, kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_size
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, heads, kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size, bias=o_bias)
        self.rotary_emb = rope_from_config(config, head_dim)
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, head_dim**-0.5, self.qkv_proj.num_kv_heads,
                              sliding_window=layer_sliding_window(config, layer_idx))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        p = self.qkv_proj
        q, k, v = self.qkv_proj(x).split([p.q_size, p.kv_size, p.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q.view(-1, p.num_heads, p.head_size),
                               k.view(-1, p.num_kv_heads, p.head_size))
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config, bias: bool) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for LLaMA (silu only)")
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention  # subclasses swap in a variant (Qwen3's q/k norms)

    def __init__(self, config, qkv_bias: bool, o_bias: bool, mlp_bias: bool, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, qkv_bias, o_bias, layer_idx)
        self.mlp = self.make_mlp(config, mlp_bias, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config, bias: bool, layer_idx: int) -> nn.Module:
        return LlamaMLP(config, bias)  # subclasses swap in a sparse MoE block

    def forward(self, positions, x, residual):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    decoder_layer_cls = LlamaDecoderLayer

    def __init__(self, config, qkv_bias: bool, o_bias: bool, mlp_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer_cls(config, qkv_bias, o_bias, mlp_bias, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.cpu_layers = None  # all layers in one C++ call each, where worker.cpu.prepare_model sets them up

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        if self.cpu_layers is not None and self.cpu_layers.supports(x):
            x, residual = self.cpu_layers(positions, x)
        else:
            for layer in self.layers:
                x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    stacked_params = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                      ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    model_cls = LlamaModel

    def __init__(self, config) -> None:
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self.model = self.model_cls(config, self.qkv_bias(config, bias), bias, bool(getattr(config, "mlp_bias", False)))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    @staticmethod
    def qkv_bias(config, attention_bias: bool) -> bool:
        return attention_bias

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights) -> None:
        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                return None
            return name

        load_params(self, weights, self.stacked_params, rename)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def qkv_bias(config, attention_bias: bool) -> bool:
        return True  # Qwen2 has biases on q/k/v but not on o_proj
