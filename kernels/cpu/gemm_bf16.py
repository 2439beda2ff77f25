"""bf16 GEMM for CPU linears on AVX512-BF16, ``y = x @ w.T (+ bias)``, on weights packed once into k-pair panels,
run on AMX tiles where the CPU has them (``amx()``).

Built only where the compiler targets AVX512-BF16 (``-march=native`` on such a CPU); elsewhere ``available()`` is
False and bf16 linears keep oneDNN's prepacked path (``F.linear`` where oneDNN has no native bf16).

The kernel: ``csrc/gemm_bf16.cpp``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.kernels.cpu.gemm import gemm_output

PANEL = 32
_NO_BIAS = torch.empty(0)


def available() -> bool:
    """Whether the extension was built with the AVX512-BF16 kernel (a CPU with those instructions)."""
    return cpu_extension.available() and cpu_extension.load().gemm_bf16_built()


def amx() -> bool:
    """Whether :func:`gemm` runs on AMX tiles here (the CPU has AMX-BF16 and Linux granted the tile state)."""
    return available() and cpu_extension.load().gemm_bf16_amx()


@dataclass(frozen=True)
class BF16PanelWeight:
    panels: torch.Tensor  # [ceil(N / 32), K / 2, 32, 2] bf16; columns past N are zero
    out_features: int  # N


def panel_shape(weight: torch.Tensor) -> tuple[int, int, int, int]:
    n, k = weight.shape
    return -(-n // PANEL), k // 2, PANEL, 2


def packable(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 2 == 0


def pack_weight(weight: torch.Tensor, out: torch.Tensor | None = None) -> BF16PanelWeight:
    """A bf16 ``weight [N, K]`` (K even) in k-pair panels, written into ``out`` (bf16, contiguous,
    :func:`panel_shape`) if given."""
    n, k = weight.shape
    count = panel_shape(weight)[0]
    padded = torch.zeros(count * PANEL, k, dtype=torch.bfloat16)
    padded[:n] = weight
    panels = padded.view(count, PANEL, k // 2, 2).transpose(1, 2)
    panels = panels.contiguous() if out is None else out.copy_(panels)
    return BF16PanelWeight(panels, n)


def gemm(x: torch.Tensor, weight: BF16PanelWeight, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype = torch.bfloat16, use_amx: bool = True,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for bf16 ``x [..., K]``, ``weight = pack_weight(w)`` and a bf16 ``bias``, summed in fp32
    (the bias too) and rounded once to bf16, or kept in fp32 (``out_dtype``), written into ``out`` (contiguous
    ``[rows, N]``) if given. ``use_amx=False`` takes the AVX512-BF16 kernel on an AMX CPU too (tests, benchmarks)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1 or rows.stride(0) % 2:
        rows = rows.contiguous()
    out = gemm_output(rows, weight.out_features, out_dtype, out)
    cpu_extension.load().gemm_bf16(rows, weight.panels, _NO_BIAS if bias is None else bias.contiguous(), out,
                                   use_amx)
    return out.view(*x.shape[:-1], weight.out_features)
