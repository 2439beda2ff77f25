"""LLaMA-style decoder layers run as one C++ call each (``kernels/cpu_layer.py``), where every layer's linears
have panel-packed weights; the model calls :class:`CPUDecoderLayers` in place of its layer loop."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels import cpu_layer
from pagedserve.worker.forward_context import get_attn_metadata


def _layer_weights(layer: nn.Module) -> cpu_layer.LayerWeights | None:
    """One layer's weights for the C++ layer, or None where it does not apply: weights not packed in panels,
    more than one tensor-parallel rank, sizes the kernels do not take, or no dense gate/up MLP (a MoE block)."""
    att, mlp = layer.self_attn, layer.mlp
    if getattr(mlp, "gate_up_proj", None) is None:
        return None
    linears = [att.qkv_proj, att.o_proj, mlp.gate_up_proj, mlp.down_proj]
    panels = [getattr(m, "panel_weight", None) for m in linears]
    rope, qkv = att.rotary_emb, att.qkv_proj
    norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    if (any(p is None for p in panels) or att.o_proj.tp_size != 1 or qkv.head_size % 8
            or len({p.panels.dtype for p in panels}) != 1
            or any(w.dtype != panels[0].panels.dtype or w.shape[0] % 8 for w in norms)
            or mlp.gate_up_proj.output_size_per_partition % 16 or rope.cos.dtype != torch.float32
            or layer.input_layernorm.eps != layer.post_attention_layernorm.eps):
        return None
    biases = [m.bias.detach() if m.bias is not None else torch.empty(0) for m in linears]
    return cpu_layer.LayerWeights(
        *norms, layer.input_layernorm.eps, [p.panels for p in panels], biases,
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
        """Whether this step can run here: the C++ attention backend, one dtype for activations and KV cache."""
        return cpu_layer.supported(get_attn_metadata(), self.layers[0].self_attn.attn.k_cache, x)

    def __call__(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers on the embeddings ``x``; returns (hidden states, residual) for the final norm."""
        md = get_attn_metadata()
        positions = positions.long().contiguous()
        residual = None
        for layer, weights in zip(self.layers, self.weights):
            attn = layer.self_attn.attn
            x, residual = cpu_layer.llama_layer(weights, x, residual, positions, attn.k_cache, attn.v_cache, md)
        return x, residual


def attach_decoder_layers(model: nn.Module) -> bool:
    """Give the model's ``cpu_layers`` slot (LLaMA-style models have one) the one-call layers, where they apply."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "cpu_layers"):
        return False
    inner.cpu_layers = CPUDecoderLayers.build(inner.layers)
    return inner.cpu_layers is not None
