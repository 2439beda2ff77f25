"""CPU tensors backed by 2 MiB transparent huge pages where the kernel offers them: the KV cache, and the packed
weights of the fp32 and bf16 panel GEMMs (``packing.py``).

Decode attention reads KV blocks scattered over GiBs of cache, and a packed panel stream crosses a 4 KiB page every
64 rows of k: on 4 KiB pages both pay TLB misses.
"""
from __future__ import annotations

import ctypes
import logging
import math
import mmap
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _madvise_hugepage(addr: int, length: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0


def empty_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on CPU, its data starting on a huge-page boundary and advised for huge
    pages before anything touches it, so the faults that map it take 2 MiB pages (memory is only taken as it is
    written). Where the advice is refused (not Linux, THP off) or the tensor is under one huge page, ordinary
    pages."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    # A mapping of its own, never touched: malloc may hand out heap pages already faulted in on 4 KiB pages (once
    # large blocks were freed, glibc raises its mmap threshold up to 32 MiB). Unmapped when the tensor is freed.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = torch.frombuffer(region, dtype=torch.uint8)
    offset = -buf.data_ptr() % HUGE_PAGE
    if not _madvise_hugepage(buf.data_ptr() + offset, nbytes // HUGE_PAGE * HUGE_PAGE):
        logger.debug("madvise(MADV_HUGEPAGE) refused; ordinary pages")
    return buf[offset:offset + nbytes].view(dtype).view(shape)


def zeros_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """:func:`empty_huge_pages`, zeroed (the first touch, which maps the huge pages)."""
    return empty_huge_pages(shape, dtype).zero_()
