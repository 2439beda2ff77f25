"""fp32 GEMM for CPU linears, ``y = x @ w.T (+ bias)``, on weights packed once into 16-column panels.

The kernel: ``csrc/gemm.cpp``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels import cpu_extension

PANEL = 16
_NO_BIAS = torch.empty(0)


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


def gemm(x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for fp32 ``x [..., K]`` and ``weight = pack_weight(w)``."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weight.out_features, dtype=torch.float32)
    cpu_extension.load().gemm_packed(rows, weight.panels, _NO_BIAS if bias is None else bias.contiguous(), out)
    return out.view(*x.shape[:-1], weight.out_features)
