"""A whole LLaMA-style decoder layer in one C++ call, for CPU fp32 or bf16 with panel-packed weights (or int8
panels) and one rank, over a cache of the activations' dtype or fp8.

It runs the same kernels as the Python modules, in the same order, on the same buffers (so its results are
bitwise those of the module path), without the ~12 module calls, shape checks and allocations around them that
Python pays per layer. The model uses it where every layer qualifies (``LlamaModel.cpu_layers``).

The kernel: ``csrc/layer.cpp``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.kernels.torch_ref import FP8_DTYPES

_NONE = torch.empty(0)


def supported(k_cache: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether this step can take the one-call layers: fp32 or bf16 activations, a cache of their dtype or fp8."""
    return x.dtype in (torch.float32, torch.bfloat16) and k_cache.dtype in (x.dtype, *FP8_DTYPES) \
        and x.device.type == "cpu"


def takes(num_heads: int, num_kv_heads: int, head_size: int, rotary_dim: int) -> bool:
    """Whether :func:`llama_layer` takes a layer of these sizes: the preconditions its kernels put on them, the
    attention's ``head_size % 8 == 0`` and ``num_heads % num_kv_heads == 0`` and the rotary's even ``rotary_dim <=
    head_size``. Hidden and intermediate sizes may be anything (the norms and SiLU-and-mul have scalar tails; the
    GEMMs, panels of any width); bf16 panels exist only for an even K (``cpu_gemm_bf16.packable``)."""
    return (head_size % 8 == 0 and num_kv_heads > 0 and num_heads % num_kv_heads == 0 and rotary_dim % 2 == 0
            and 0 <= rotary_dim <= head_size)


@dataclass(frozen=True)
class LayerWeights:
    """What :func:`llama_layer` reads of one decoder layer, gathered once (the KV cache is bound later)."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    eps: float
    weights: list[torch.Tensor]  # panels of qkv, o_proj, gate_up, down (cpu_gemm's fp32, cpu_gemm_bf16's bf16 or
    # cpu_gemm_int8's int8)
    scales: list[torch.Tensor]  # an int8 weight's per-channel scales, empty for the others
    biases: list[torch.Tensor]  # each empty where the layer has none
    dims: list[int]  # heads, KV heads, head size, rotary dims, out features of qkv, o_proj, gate_up, down
    cos: torch.Tensor
    sin: torch.Tensor
    scale: float


def llama_layer(lw: LayerWeights, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, md, k_scale: float = 1.0,
                v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions`` int64 contiguous; ``md`` the step's attention metadata (int32 tables, int64 slots);
    ``k_scale``, ``v_scale`` an fp8 cache's."""
    out, residual = cpu_extension.load().llama_layer(
        x, _NONE if residual is None else residual, positions, lw.ln1, lw.ln2, lw.eps, lw.weights, lw.scales,
        lw.biases, lw.dims, lw.cos, lw.sin, k_cache, v_cache, md.slot_mapping, md.block_tables, md.query_start_loc,
        md.seq_lens, lw.scale, k_scale, v_scale)
    return out, residual
