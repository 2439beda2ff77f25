"""Weight-only int8 GEMM for CPU linears, ``y = (x @ q.T) * scale (+ bias)``, on int8 weights packed once into
32-column panels, activations and outputs in fp32 or bf16 (:func:`torch_ref.int8_linear` is the spec).

The kernel: ``csrc/gemm_int8.cpp`` (FMA tiles everywhere; for bf16 rows AMX tiles from 4 rows where the CPU has
AMX, else AVX512-BF16 dot products from 7 where built).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.kernels.cpu.gemm import gemm_output

PANEL = 32
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)
_NO_BIAS = torch.empty(0)


def available() -> bool:
    """Whether the C++ extension (and so this kernel, on any CPU it builds for) is there."""
    return cpu_extension.available()


@dataclass(frozen=True)
class Int8PanelWeight:
    panels: torch.Tensor  # [ceil(N / 32), K, 32] int8; columns past N are zero
    scale: torch.Tensor  # [N] fp32, per output channel
    out_features: int  # N


def panel_shape(weight: torch.Tensor) -> tuple[int, int, int]:
    n, k = weight.shape
    return -(-n // PANEL), k, PANEL


def supports(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether an int8 ``weight [N, K]`` can be packed for activations of ``dtype``; any N and K >= 1 can."""
    return (weight.dtype == torch.int8 and weight.dim() == 2 and weight.shape[1] > 0 and weight.device.type == "cpu"
            and dtype in ACTIVATION_DTYPES)


def pack_weight(weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> Int8PanelWeight:
    """An int8 ``weight [N, K]`` and its fp32 ``scale [N]`` in panels, written into ``out`` (int8, contiguous,
    :func:`panel_shape`) if given."""
    n, k = weight.shape
    count = panel_shape(weight)[0]
    padded = torch.zeros(count * PANEL, k, dtype=torch.int8)
    padded[:n] = weight
    panels = padded.view(count, PANEL, k).transpose(1, 2)
    panels = panels.contiguous() if out is None else out.copy_(panels)
    return Int8PanelWeight(panels, scale.float().contiguous(), n)


def gemm(x: torch.Tensor, weight: Int8PanelWeight, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, use_amx: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(x @ q.T) * scale + bias`` for fp32 or bf16 ``x [..., K]``, ``weight = pack_weight(q, scale)`` and a
    ``bias`` of x's dtype, summed in fp32 and rounded once to x's dtype, or kept fp32 (``out_dtype``), written into
    ``out`` (contiguous ``[rows, N]``) if given. From 4 bf16 rows on AMX tiles where the CPU has them, unless
    ``use_amx=False`` (tests, benchmarks)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = gemm_output(rows, weight.out_features, out_dtype or x.dtype, out)
    cpu_extension.load().gemm_int8(rows, weight.panels, weight.scale, _NO_BIAS if bias is None else bias.contiguous(),
                                   out, use_amx)
    return out.view(*x.shape[:-1], weight.out_features)
