"""Triton backend: the ops of :mod:`pagedserve.kernels.torch_ref`, same signatures and semantics.

Kernels live in ``triton_attention`` and ``triton_cache``; this module checks arguments and
dispatches. On CPU tensors the kernels only run under ``TRITON_INTERPRET=1`` (tests).
"""
from __future__ import annotations

import torch

from pagedserve.kernels import torch_ref
from pagedserve.kernels.triton import attention as triton_attention
from pagedserve.kernels.triton import cache as triton_cache

_INDEX_DTYPES = (torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_index(name: str, t: torch.Tensor, ndim: int, device: torch.device) -> None:
    _check(t.dtype in _INDEX_DTYPES, f"{name} must be int32 or int64, got {t.dtype}")
    _check(t.dim() == ndim, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    _check(t.device == device, f"{name} is on {t.device}, expected {device}")


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _check(k_cache.dim() == 4, "caches must be [num_blocks, block_size, num_kv_heads, head_size]")
    _check(k_cache.shape == v_cache.shape, "k_cache and v_cache shapes differ")
    _check(k_cache.device == v_cache.device, "k_cache and v_cache devices differ")
    _check(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches need a unit head_size stride")


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int, -1 = padding (skip)
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    _check_cache_pair(k_cache, v_cache)
    _check(key.dim() == 3 and key.shape == value.shape, "key and value must both be [T, Hkv, D]")
    _check(key.shape[1:] == k_cache.shape[2:], f"key {tuple(key.shape)} does not fit cache {tuple(k_cache.shape)}")
    _check(key.device == k_cache.device and value.device == k_cache.device, "key/value not on the cache device")
    _check_index("slot_mapping", slot_mapping, 1, k_cache.device)
    _check(slot_mapping.shape[0] == key.shape[0], "slot_mapping needs one slot per token")
    triton_cache.reshape_and_cache(
        _unit_last_stride(key),
        _unit_last_stride(value),
        k_cache,
        v_cache,
        slot_mapping,
        interpreting=triton_attention._interpreting(),
        k_scale=k_scale,
        v_scale=v_scale,
    )


def attention_supported(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the Triton attention kernel takes these shapes (else :func:`paged_attention` runs the torch
    reference): head sizes and GQA groups are padded to powers of two and masked, so any of them, but ``tl.dot``
    needs each dimension >= 16 (the head size padded: 9 and up) and the tiles are sized for a padded head size of
    at most 256. ``reshape_and_cache``'s kernel masks every size and takes any."""
    head_pad = 1 << max(0, query.shape[2] - 1).bit_length()
    return 16 <= head_pad <= 256


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    query_start_loc: torch.Tensor,  # [B + 1] int
    seq_lens: torch.Tensor,  # [B] int
    scale: float,
    out: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Sliding windows, logit soft-caps and fp8 caches run in the kernel (block-table entries below a row's
    window, possibly ``NULL_BLOCK``, are never read); only shapes failing :func:`attention_supported` take the
    torch reference."""
    _check_cache_pair(k_cache, v_cache)
    _check(query.dim() == 3, "query must be [T, Hq, D]")
    _check(query.dtype in _FLOAT_DTYPES, f"unsupported query dtype {query.dtype}")
    _check(query.shape[2] == k_cache.shape[3], "query and cache head sizes differ")
    _check(query.shape[1] % k_cache.shape[2] == 0, "num_q_heads must be a multiple of num_kv_heads")
    _check(query.device == k_cache.device, "query is not on the cache device")
    _check_index("block_tables", block_tables, 2, query.device)
    _check_index("query_start_loc", query_start_loc, 1, query.device)
    _check_index("seq_lens", seq_lens, 1, query.device)
    num_seqs = seq_lens.shape[0]
    _check(query_start_loc.shape[0] == num_seqs + 1, "query_start_loc must have num_seqs + 1 entries")
    _check(block_tables.shape[0] >= num_seqs, "block_tables needs a row per sequence")
    _check(sliding_window is None or sliding_window >= 1, f"sliding_window must be >= 1, got {sliding_window}")
    _check(logits_soft_cap is None or logits_soft_cap > 0, f"logits_soft_cap must be > 0, got {logits_soft_cap}")
    if not attention_supported(query, k_cache):
        return torch_ref.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                         out, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                         k_scale=k_scale, v_scale=v_scale)
    if out is None:
        out = torch.empty_like(query)
    _check(out.shape == query.shape and out.dtype == query.dtype, "out must match query")
    query = _unit_last_stride(query)
    dst = out if out.stride(-1) == 1 else torch.empty_like(query)
    triton_attention.paged_attention(
        query,
        k_cache,
        v_cache,
        _unit_last_stride(block_tables),
        query_start_loc.contiguous(),
        seq_lens.contiguous(),
        scale,
        dst,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    if dst is not out:
        out.copy_(dst)
    return out


def copy_blocks(
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,  # [M, 2] (src, dst) within the same caches
) -> None:
    _check(len(k_caches) == len(v_caches), "need one V cache per K cache")
    if block_mapping.numel() == 0 or not k_caches:
        return
    _check(block_mapping.dim() == 2 and block_mapping.shape[1] == 2, "block_mapping must be [M, 2]")
    _check(block_mapping.dtype in _INDEX_DTYPES, "block_mapping must be int32 or int64")
    triton_cache.copy_blocks(k_caches, v_caches, block_mapping)


def swap_blocks(
    src: torch.Tensor,  # [N_src, bs, Hkv, D] (one layer, K or V)
    dst: torch.Tensor,  # [N_dst, bs, Hkv, D], possibly on another device
    block_mapping: torch.Tensor,  # [M, 2] (src block, dst block)
) -> None:
    if block_mapping.numel() == 0:
        return
    _check(src.shape[1:] == dst.shape[1:] and src.dtype == dst.dtype, "src and dst block layouts differ")
    _check(block_mapping.dim() == 2 and block_mapping.shape[1] == 2, "block_mapping must be [M, 2]")
    triton_cache.swap_blocks(src, dst, block_mapping)
