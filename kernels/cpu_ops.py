"""CPU backend: the C++ kernels of ``cpu_attention`` / ``cpu_fused`` for fp32 and bf16, torch reference ops else."""
from __future__ import annotations

from pagedserve.kernels import cpu_attention, cpu_fused, torch_ref
from pagedserve.kernels.torch_ref import copy_blocks, swap_blocks  # noqa: F401


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    if key.dtype == k_cache.dtype and cpu_fused.usable(key, value, k_cache) and key.stride(1) == key.shape[2] \
            and value.stride(1) == value.shape[2]:
        return cpu_fused.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping.long())
    return torch_ref.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out=None, *,
                    sliding_window=None, logits_soft_cap=None):
    if cpu_attention.supports(query, k_cache):
        if query.stride(1) != query.shape[2]:
            query = query.contiguous()
        return cpu_attention.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                             scale, out, sliding_window=sliding_window,
                                             logits_soft_cap=logits_soft_cap)
    return torch_ref.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out,
                                     sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
