"""Paged attention for CPUs in C++: decodes and prefill chunks of one step in one call, fp32 or bf16 (on AVX512-BF16
CPUs bf16 items go to their own kernel, and on AMX CPUs bf16 prefill rows to tiles), over a cache of the query's
dtype or fp8.

The kernel: ``csrc/attention.cpp`` (bf16 on AVX512-BF16: ``csrc/attention_bf16.cpp``; bf16 prefill on AMX:
``csrc/attention_amx.cpp``).
"""
from __future__ import annotations

import torch

from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.kernels.torch_ref import FP8_DTYPES


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors (else the caller uses the torch reference): CPU fp32 or bf16 ``query
    [T, Hq, D]`` with unit stride along D (the CPU backend makes each token's heads contiguous), a contiguous cache
    ``[N, bs, Hkv, D]`` of the same dtype (or fp8) and D, ``D % 8 == 0`` (the kernel steps 8 lanes along D), Hq a
    multiple of Hkv; the extension built. The V cache is the K cache's twin; the index tensors are converted here."""
    return (query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16)
            and k_cache.dtype in (query.dtype, *FP8_DTYPES) and query.dim() == 3 and k_cache.dim() == 4
            and query.shape[2] % 8 == 0 and k_cache.shape[3] == query.shape[2]
            and query.shape[1] % k_cache.shape[2] == 0 and query.stride(-1) == 1 and k_cache.is_contiguous()
            and cpu_extension.available())


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None, *, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                    use_amx: bool = True) -> torch.Tensor:
    """Same arguments and result as :func:`pagedserve.kernels.torch_ref.paged_attention`. ``use_amx=False`` keeps
    bf16 prefill rows off AMX tiles (for tests and benchmarks; decode rows never use them)."""
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    cpu_extension.load().paged_attention(query, k_cache, v_cache, _int32(block_tables), _int32(query_start_loc),
                                         _int32(seq_lens), scale, out, sliding_window or 0, logits_soft_cap or 0.0,
                                         k_scale, v_scale, use_amx)
    return out


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()
