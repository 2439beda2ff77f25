"""``x @ W.T + bias`` through whichever packed copy of W the layer was given (``packing.py``), else ``F.linear`` (the
torch reference for an int8 weight, on any device)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import cpu_gemm, cpu_gemm_bf16, cpu_gemm_int8, torch_ref


def linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ layer.weight.T + bias`` through the layer's packed weight where it has one. ``out_dtype`` float32
    asks for fp32 outputs from bf16 inputs (logits), which the bf16 panel GEMM gives without a rounding step."""
    panels = getattr(layer, "panel_weight", None)
    if isinstance(panels, cpu_gemm_int8.Int8PanelWeight):
        return cpu_gemm_int8.gemm(x, panels, bias, out_dtype)
    if isinstance(panels, cpu_gemm_bf16.BF16PanelWeight):
        return cpu_gemm_bf16.gemm(x, panels, bias, out_dtype or torch.bfloat16)
    if isinstance(panels, cpu_gemm.PanelWeight):
        return cpu_gemm.gemm(x, panels, bias)
    scale = getattr(layer, "weight_scale", None)
    if scale is not None:
        return torch_ref.int8_linear(x, layer.weight, scale, bias, out_dtype)
    packed = getattr(layer, "packed_weight", None)
    if packed is None:
        return F.linear(x, layer.weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
