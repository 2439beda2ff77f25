"""CPU backend: the torch reference ops, with decode rows in the C++ kernel of ``cpu_attention``."""
from __future__ import annotations

import torch

from pagedserve.kernels import cpu_attention, torch_ref
from pagedserve.kernels.torch_ref import copy_blocks, reshape_and_cache, swap_blocks  # noqa: F401


def _decode(query, k_cache, v_cache, block_tables, seq_lens, scale):
    if query.dtype != torch.float32 or k_cache.dtype != torch.float32:
        return torch_ref._decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale)
    return cpu_attention.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out=None):
    return torch_ref.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                     out, decode_fn=_decode)
