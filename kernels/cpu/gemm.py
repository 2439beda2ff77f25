"""fp32 GEMM for CPU linears, ``y = x @ w.T (+ bias)``, on weights packed once into 16-column panels.

The kernel: ``csrc/gemm.cpp``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.cpu import extension as cpu_extension

PANEL = 16
_NO_BIAS = torch.empty(0)


def gemm_output(rows: torch.Tensor, n: int, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """A panel GEMM's output for ``rows [M, K]``: ``out``, checked to be a contiguous ``[M, n]`` tensor of ``dtype``,
    or a new one."""
    if out is None:
        return torch.empty(rows.shape[0], n, dtype=dtype)
    if out.shape != (rows.shape[0], n) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{rows.shape[0]}, {n}] {dtype} tensor, got "
                         f"{list(out.shape)} {out.dtype}")
    return out


@dataclass(frozen=True)
class PanelWeight:
    panels: torch.Tensor  # [ceil(N / 16), K, 16]; columns past N are zero
    out_features: int  # N


def panel_shape(weight: torch.Tensor) -> tuple[int, int, int]:
    n, k = weight.shape
    return -(-n // PANEL), k, PANEL


def pack_weight(weight: torch.Tensor, out: torch.Tensor | None = None) -> PanelWeight:
    """An fp32 ``weight [N, K]`` in panels, written into ``out`` (fp32, contiguous, :func:`panel_shape`) if
    given."""
    n, k = weight.shape
    count = panel_shape(weight)[0]
    padded = torch.zeros(count * PANEL, k, dtype=torch.float32)
    padded[:n] = weight
    panels = padded.view(count, PANEL, k).transpose(1, 2)
    return PanelWeight(panels.contiguous() if out is None else out.copy_(panels), n)


def gemm(x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for fp32 ``x [..., K]`` and ``weight = pack_weight(w)``, written into ``out`` (contiguous
    ``[rows, N]`` fp32) if given."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = gemm_output(rows, weight.out_features, torch.float32, out)
    cpu_extension.load().gemm_packed(rows, weight.panels, _NO_BIAS if bias is None else bias.contiguous(), out)
    return out.view(*x.shape[:-1], weight.out_features)
