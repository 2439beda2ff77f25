"""Linear layers on CPU with each weight reordered once, after loading, into the layout its GEMM reads.

``F.linear`` (MKL sgemm) repacks the weight on every call; at decode batch sizes that repacking is a large share of
the call. fp32 weights go into 16-column panels for ``kernels/cpu_gemm.py`` on AVX2 CPUs without AVX-512 (where it
was measured against oneDNN: 1.2-1.3x faster at 1-64 rows, on par at 256-2048); elsewhere, and for
bf16/fp16, oneDNN's blocked layout. The packed weight replaces the plain one (same memory), except where the weight
is shared (a tied LM head): that one is kept for the other users and packed as a copy.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.config import cpu_flags
from pagedserve.kernels import cpu_extension, cpu_gemm

logger = logging.getLogger(__name__)


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """Dtypes oneDNN runs natively here; others keep ``F.linear`` (bf16 on AVX2 would be emulated, slowly)."""
    if not torch.backends.mkldnn.is_available():
        return ()
    dtypes = [torch.float32]
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtypes.append(torch.bfloat16)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        dtypes.append(torch.float16)
    return tuple(dtypes)


def panel_gemm_preferred(flags: set[str] | None = None) -> bool:
    """Whether fp32 linears use the panel GEMM: an AVX2+FMA CPU without AVX-512 (oneDNN's 512-bit kernels were
    not measured against it) where the C++ extension builds."""
    flags = cpu_flags() if flags is None else flags
    return {"avx2", "fma"} <= flags and "avx512f" not in flags and cpu_extension.load() is not None


def linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    panels = getattr(layer, "panel_weight", None)
    if panels is not None:
        return cpu_gemm.gemm(x, panels, bias)
    packed = getattr(layer, "packed_weight", None)
    if packed is None:
        return F.linear(x, layer.weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packer(dtype: torch.dtype, panels: bool, batch_hint: int) -> tuple[str, Callable[[torch.Tensor], object]] | None:
    """(attribute, pack function) for a weight of this dtype, or None to keep ``F.linear``."""
    if dtype == torch.float32 and panels:
        return "panel_weight", cpu_gemm.pack_weight
    if dtype in packable_dtypes():
        return "packed_weight", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
    return None


def pack_linears(model: nn.Module, batch_hint: int = 128, panels: bool | None = None) -> int:
    """Pack every linear weight; returns how many modules got a packed weight. A weight only its layer uses is
    replaced by its packed copy. A shared one (a tied LM head: the embedding reads the same tensor) stays, and its
    packed copy is made once and given to every packable module that shares it, as vLLM's CPU backend does: one
    more copy of the vocabulary matrix, for an LM head that F.linear ran at a third of the speed (its MKL call
    repacks the weight each time; measured on the demo model, 1.2 ms against 0.6 ms a 5-row step, and 5-10% of
    the per-token latency at concurrency 1 and 16). ``panels``: use the panel GEMM for fp32 (default: where
    :func:`panel_gemm_preferred`)."""
    if panels is None:
        panels = panel_gemm_preferred()
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    shared: dict[int, object] = {}  # id(weight) -> its packed copy
    packed = extra = 0
    kinds = set()
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not getattr(module, "packable", False) or w is None or w.device.type != "cpu" or w.dim() != 2:
            continue
        packer = _packer(w.dtype, panels, batch_hint)
        if packer is None:
            continue
        attr, pack = packer
        kinds.add(attr)
        if counts.get(id(w), 0) > 1:
            if id(w) not in shared:
                shared[id(w)] = pack(w.detach())
                extra += w.numel() * w.element_size()
            setattr(module, attr, shared[id(w)])
        else:
            setattr(module, attr, pack(w.detach()))
            module.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)  # freed: packed holds it
        packed += 1
    if packed:
        logger.info("packed %d linear weights (%s); shared weights copied: %.1f MiB", packed,
                    ", ".join(sorted(kinds)), extra / 2**20)
    return packed
