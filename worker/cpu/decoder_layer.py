"""LLaMA-style decoder layers run as one C++ call each (``kernels/cpu/layer.py``), where every layer's linears
have panel-packed weights; the model calls :class:`CPUDecoderLayers` in place of its layer loop."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.cpu import gemm as cpu_gemm
from pagedserve.kernels.cpu import gemm_bf16 as cpu_gemm_bf16
from pagedserve.kernels.cpu import gemm_int8 as cpu_gemm_int8
from pagedserve.kernels.cpu import layer as cpu_layer
from pagedserve.worker.forward_context import current_backend, get_attn_metadata
from pagedserve.worker.layers.activation import SiluAndMul
from pagedserve.worker.layers.layernorm import RMSNorm
from pagedserve.worker.layers.rotary import RotaryEmbedding

# The modules of exactly a LLaMA layer: anything more (q/k norms, post-norms) is math the C++ layer does not do.
_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTN_PARTS = {"qkv_proj", "o_proj", "rotary_emb", "attn"}
_MLP_PARTS = {"gate_up_proj", "down_proj", "act_fn"}


def _llama_shaped(layer: nn.Module) -> bool:
    """Whether the layer computes exactly what ``llama_layer`` does: pre-norm RMSNorm, plain rotary (no per-sequence
    tables), SiLU-and-mul (the window and soft-cap are checked with the sizes)."""
    att, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if att is None or mlp is None:
        return False
    names = [{n for n, _ in m.named_children()} for m in (layer, att, mlp)]
    return (names == [_LAYER_PARTS, _ATTN_PARTS, _MLP_PARTS] and type(mlp.act_fn) is SiluAndMul
            and type(att.rotary_emb) is RotaryEmbedding
            and all(type(n) is RMSNorm for n in (layer.input_layernorm, layer.post_attention_layernorm)))


def _layer_weights(layer: nn.Module) -> cpu_layer.LayerWeights | None:
    """One layer's weights for the C++ layer, or None where it does not apply: weights not packed in panels of the
    activations' dtype (the norms') or int8 ones, more than one tensor-parallel rank, sizes the kernels do not take
    (``cpu_layer.takes``), a sliding window or soft-cap, or a layer that is not exactly LLaMA's."""
    if not _llama_shaped(layer):
        return None
    att, mlp = layer.self_attn, layer.mlp
    linears = [att.qkv_proj, att.o_proj, mlp.gate_up_proj, mlp.down_proj]
    panels = [getattr(m, "panel_weight", None) for m in linears]
    rope, qkv = att.rotary_emb, att.qkv_proj
    norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    act = norms[0].dtype
    if (not all(isinstance(p, cpu_gemm_int8.Int8PanelWeight) or (
                isinstance(p, (cpu_gemm.PanelWeight, cpu_gemm_bf16.BF16PanelWeight)) and p.panels.dtype == act)
                for p in panels)
            or act not in (torch.float32, torch.bfloat16) or norms[1].dtype != act
            or att.o_proj.tp_size != 1
            or not cpu_layer.takes(qkv.num_heads, qkv.num_kv_heads, qkv.head_size, rope.rotary_dim)
            or rope.cos.dtype != torch.float32
            or layer.input_layernorm.eps != layer.post_attention_layernorm.eps
            or att.attn.sliding_window is not None or att.attn.logits_soft_cap is not None):
        return None
    biases = [m.bias.detach() if m.bias is not None else torch.empty(0) for m in linears]
    return cpu_layer.LayerWeights(
        *norms, layer.input_layernorm.eps, [p.panels for p in panels],
        [getattr(p, "scale", torch.empty(0)) for p in panels], biases,
        [qkv.num_heads, qkv.num_kv_heads, qkv.head_size, rope.rotary_dim, *(p.out_features for p in panels)],
        rope.cos, rope.sin, att.attn.scale)


class CPUDecoderLayers:
    """A model's decoder layers with the weights the one-call C++ layer reads, gathered once after packing."""

    def __init__(self, layers: nn.ModuleList, weights: list[cpu_layer.LayerWeights]) -> None:
        self.layers = layers
        self.weights = weights

    @classmethod
    def build(cls, layers: nn.ModuleList) -> CPUDecoderLayers | None:
        """None unless every layer qualifies."""
        weights = [_layer_weights(layer) for layer in layers]
        return cls(layers, weights) if weights and all(weights) else None

    def supports(self, x: torch.Tensor) -> bool:
        """Whether this step can run here: a KV cache of the activations' dtype or fp8."""
        return cpu_layer.supported(self.layers[0].self_attn.attn.k_cache, x)

    def __call__(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers on the embeddings ``x``; returns (hidden states, residual) for the final norm."""
        md, backend = get_attn_metadata(), current_backend()
        positions = positions.long().contiguous()
        residual = None
        for layer, weights in zip(self.layers, self.weights):
            attn = layer.self_attn.attn
            x, residual = backend.llama_layer(weights, x, residual, positions, attn.k_cache, attn.v_cache, md,
                                                attn.k_scale, attn.v_scale)
        return x, residual


def attach_decoder_layers(model: nn.Module) -> bool:
    """Give the model's ``cpu_layers`` slot (LLaMA-style models have one) the one-call layers, where they apply."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "cpu_layers"):
        return False
    inner.cpu_layers = CPUDecoderLayers.build(inner.layers)
    return inner.cpu_layers is not None
