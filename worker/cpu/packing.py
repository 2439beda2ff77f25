"""Every linear weight of a CPU model reordered once, after loading, into the layout its GEMM reads
(the kernel backend's ``linear`` runs them).

``F.linear`` (MKL sgemm) repacks the weight on every call; at decode batch sizes that repacking is a large share of
the call. fp32 weights go into 16-column panels for ``kernels/cpu/gemm.py`` on AVX2 CPUs and on AVX-512 ones without
bf16 instructions (:func:`panel_gemm_preferred`); bf16 weights into k-pair panels for
``kernels/cpu/gemm_bf16.py`` on CPUs with AVX512-BF16; int8 weights (``quantization="int8"``) into int8 panels
for ``kernels/cpu/gemm_int8.py``; elsewhere oneDNN's blocked layout (int8 ones: the torch reference). The packed
weight replaces the plain one (same memory), except where the weight is shared (a tied LM head): that one is kept
for the other users and packed as a copy.
"""
from __future__ import annotations

import logging
import math

import torch
from torch import nn

from pagedserve.kernels.cpu import gemm as cpu_gemm
from pagedserve.kernels.cpu import gemm_bf16 as cpu_gemm_bf16
from pagedserve.kernels.cpu import gemm_int8 as cpu_gemm_int8
from pagedserve.worker.cpu.cpuinfo import cpu_flags
from pagedserve.worker.cpu.hugepages import empty_huge_pages

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
    """Whether fp32 linears use the panel GEMM (where the C++ kernels run), and so the one-call C++ layer: an AVX2+FMA
    CPU without AVX-512, or an AVX-512 one without bf16 matmul instructions, where fp32 is what ``dtype="auto"``
    runs (measured on Cascade Lake: oneDNN's linear is faster from 128 rows, the one-call layer faster end to end).
    Where bf16 runs natively, fp32 linears keep oneDNN (not measured against the panels there)."""
    flags = cpu_flags() if flags is None else flags
    return {"avx2", "fma"} <= flags and ("avx512f" not in flags or not flags & {"avx512_bf16", "amx_bf16"})


def _panel_kernel(w: torch.Tensor):
    return {torch.bfloat16: cpu_gemm_bf16, torch.int8: cpu_gemm_int8}.get(w.dtype, cpu_gemm)


class _PanelArena:
    """Consecutive slices of one huge-page buffer for all of a model's panels of one dtype: apart, weights under
    glibc's mmap threshold came from the heap on 4 KiB pages. Pages are only taken as the packing writes them."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        sizes = [math.prod(_panel_kernel(w).panel_shape(w)) for w in weights]
        self.buffer = empty_huge_pages((sum(sizes),), weights[0].dtype)
        self.used = 0

    def pack(self, module: nn.Module, w: torch.Tensor) -> PanelWeight:
        kernel = _panel_kernel(w)
        shape = kernel.panel_shape(w)
        n = math.prod(shape)
        out = self.buffer[self.used:self.used + n].view(shape)
        self.used += n
        if w.dtype == torch.int8:
            return cpu_gemm_int8.pack_weight(w, module.weight_scale.detach(), out)
        return kernel.pack_weight(w, out)


PanelWeight = cpu_gemm.PanelWeight | cpu_gemm_bf16.BF16PanelWeight | cpu_gemm_int8.Int8PanelWeight


def _packer(w: torch.Tensor, panels: bool, bf16_panels: bool, int8_dtype: torch.dtype | None) -> str | None:
    """The attribute a packed copy of this weight goes to, or None to keep ``F.linear`` (the torch reference for
    int8). ``int8_dtype``: the activations' dtype where int8 weights go to the int8 panel GEMM, else None."""
    if w.dtype == torch.int8:
        return "panel_weight" if int8_dtype is not None and cpu_gemm_int8.supports(w, int8_dtype) else None
    if (w.dtype == torch.float32 and panels) or (bf16_panels and cpu_gemm_bf16.packable(w)):
        return "panel_weight"
    if w.dtype in packable_dtypes():
        return "packed_weight"
    return None


def pack_linears(model: nn.Module, batch_hint: int = 128, panels: bool | None = None,
                 bf16_panels: bool | None = None, int8_panels: bool | None = None) -> int:
    """Pack every linear weight; returns how many modules got a packed weight. A weight only its layer uses is replaced
    by its packed copy. A shared one (a tied LM head: the embedding reads the same tensor) stays, and its packed copy is
    made once and given to every packable module that shares it, as vLLM's CPU backend does: one more copy of the
    vocabulary matrix, for an LM head that ``F.linear`` runs far slower (its MKL call repacks the weight each time).
    ``panels``: use the C++ panel GEMM for fp32 (default: where :func:`panel_gemm_preferred`); ``bf16_panels``: the
    AVX512-BF16 one for bf16 (default: where it is built); ``int8_panels``: the int8 one for int8 weights (default:
    where the extension builds). All need the C++ extension; with none, every weight goes to oneDNN's layout, int8
    ones stay for the torch reference."""
    if panels is None:
        panels = panel_gemm_preferred()
    if bf16_panels is None:
        bf16_panels = cpu_gemm_bf16.available()
    if int8_panels is None:
        int8_panels = cpu_gemm_int8.available()
    # The activations' dtype: the model's, which its scales (always fp32) do not tell.
    model_dtype = next((p.dtype for n, p in model.named_parameters() if p.is_floating_point()
                        and not n.endswith("weight_scale")), torch.float32)
    int8_dtype = model_dtype if int8_panels else None
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    todo: list[tuple[nn.Module, torch.Tensor, str]] = []
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not getattr(module, "packable", False) or w is None or w.device.type != "cpu" or w.dim() != 2:
            continue
        attr = _packer(w, panels, bf16_panels, int8_dtype)
        if attr is not None:
            todo.append((module, w, attr))
    unique = {id(w): w for _, w, attr in todo if attr == "panel_weight"}
    arenas = {dt: _PanelArena([w for w in unique.values() if w.dtype == dt])
              for dt in {w.dtype for w in unique.values()}}
    shared: dict[int, object] = {}  # id(weight) -> its packed copy
    extra = 0
    for module, w, attr in todo:
        if id(w) not in shared:
            shared[id(w)] = arenas[w.dtype].pack(module, w.detach()) if attr == "panel_weight" else \
                torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
            if counts.get(id(w), 0) > 1:
                extra += w.numel() * w.element_size()
        setattr(module, attr, shared[id(w)])
        if counts.get(id(w), 0) <= 1:
            module.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)  # freed: packed holds it
    if todo:
        logger.info("packed %d linear weights (%s); shared weights copied: %.1f MiB", len(todo),
                    ", ".join(sorted({attr for _, _, attr in todo})), extra / 2**20)
    return len(todo)
