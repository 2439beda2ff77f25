"""``x @ W.T + bias`` through whichever packed copy of W the layer was given (``packing.py``), else ``F.linear`` (the
torch reference for an int8 weight, on any device)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import cpu_gemm, cpu_gemm_bf16, cpu_gemm_int8, torch_ref

# The most rows of output a layer keeps between calls (reuse_out): a decode batch's logits, not a prompt's.
REUSED_OUT_ROWS = 256


def linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype | None = None, reuse_out: bool = False) -> torch.Tensor:
    """``x @ layer.weight.T + bias`` through the layer's packed weight where it has one. ``out_dtype`` float32
    asks for fp32 outputs from bf16 inputs (logits), which the bf16 panel GEMM gives without a rounding step.
    ``reuse_out``: the caller is done with a call's result before its next call, so the panel GEMMs may write into
    a buffer the layer keeps (up to ``REUSED_OUT_ROWS`` rows). A new output of tens of MB (the logits of 64+ rows)
    comes from mmap, and faulting its pages in made the LM head ~1.6x slower on CPU."""
    panels = getattr(layer, "panel_weight", None)
    if panels is not None:
        dtype = torch.float32 if isinstance(panels, cpu_gemm.PanelWeight) else out_dtype or x.dtype
        out = _reused_out(layer, x, panels.out_features, dtype) if reuse_out else None
        if isinstance(panels, cpu_gemm_int8.Int8PanelWeight):
            return cpu_gemm_int8.gemm(x, panels, bias, dtype, out=out)
        if isinstance(panels, cpu_gemm_bf16.BF16PanelWeight):
            return cpu_gemm_bf16.gemm(x, panels, bias, dtype, out=out)
        return cpu_gemm.gemm(x, panels, bias, out=out)
    scale = getattr(layer, "weight_scale", None)
    if scale is not None:
        return torch_ref.int8_linear(x, layer.weight, scale, bias, out_dtype)
    packed = getattr(layer, "packed_weight", None)
    if packed is None:
        return F.linear(x, layer.weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _reused_out(layer: nn.Module, x: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The first rows of the layer's kept ``[REUSED_OUT_ROWS, n]`` output buffer, one for each of ``x``'s rows; None
    (a new output) for more rows."""
    rows = x.numel() // x.shape[-1]
    if rows > REUSED_OUT_ROWS:
        return None
    buf = getattr(layer, "reused_out", None)
    if buf is None or buf.dtype != dtype:
        buf = layer.reused_out = torch.empty(REUSED_OUT_ROWS, n, dtype=dtype)
    return buf[:rows]
