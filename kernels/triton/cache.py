"""KV-cache writes and block moves: reshape_and_cache and copy_blocks in Triton, swap_blocks in torch.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_size]`` for K and for V.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import torch_ref

# Elements one copy_blocks program moves; a block is usually a few thousand to tens of thousands.
COPY_CHUNK = 4096

_WORD_TYPES = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,
    k_cache_ptr,  # [N, bs, Hkv, D]
    v_cache_ptr,
    slot_mapping_ptr,  # [T]
    k_scale,  # an fp8 cache stores key / k_scale, saturated to FP8_MAX (only read when FP8)
    v_scale,
    num_kv_heads,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE

    h = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    d = tl.arange(0, HEAD_PAD)
    mask = (h < num_kv_heads)[:, None] & (d < HEAD_SIZE)[None, :]

    k = tl.load(key_ptr + tok * stride_key_tok + h[:, None] * stride_key_head + d[None, :], mask=mask)
    if FP8:
        k = tl.clamp(k.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
    k_dst = k_cache_ptr + block * stride_kc_block + block_offset * stride_kc_slot
    tl.store(k_dst + h[:, None] * stride_kc_head + d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)

    v = tl.load(value_ptr + tok * stride_value_tok + h[:, None] * stride_value_head + d[None, :], mask=mask)
    if FP8:
        v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
    v_dst = v_cache_ptr + block * stride_vc_block + block_offset * stride_vc_slot
    tl.store(v_dst + h[:, None] * stride_vc_head + d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    interpreting: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    fp8 = torch_ref.is_fp8(k_cache)
    if interpreting:
        # The interpreter truncates fp32 -> fp16/bf16 instead of rounding to nearest even (and has no fp8 stores):
        # rows arrive in the cache's format, to be copied.
        key, value = torch_ref.to_cache(key, k_cache, k_scale), torch_ref.to_cache(value, v_cache, v_scale)
        if fp8:
            key, value, k_cache, v_cache = (torch_ref.as_bits(t) for t in (key, value, k_cache, v_cache))
            fp8 = False
    head_pad = triton.next_power_of_2(head_size)
    heads_per_program = min(triton.next_power_of_2(num_kv_heads), max(1, 2048 // head_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, heads_per_program))
    _reshape_and_cache_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        num_kv_heads,
        *key.stride()[:2],
        *value.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_PER_PROGRAM=heads_per_program,
        FP8=fp8,
        FP8_MAX=torch.finfo(k_cache.dtype).max if fp8 else 0.0,
    )


@triton.jit
def _copy_blocks_kernel(
    cache_ptrs_ptr,  # int64 [num_caches]: data_ptr of every K and V cache
    block_mapping_ptr,  # [M, 2] (src, dst)
    stride_map,
    block_numel,  # elements in one block
    stride_block,
    WORD: tl.constexpr,  # integer type of the element's width: a bit copy, whatever the dtype
    CHUNK: tl.constexpr,
):
    cache = tl.load(cache_ptrs_ptr + tl.program_id(0)).to(tl.pointer_type(WORD))
    pair = tl.program_id(1).to(tl.int64)
    src = tl.load(block_mapping_ptr + pair * stride_map).to(tl.int64)
    dst = tl.load(block_mapping_ptr + pair * stride_map + 1).to(tl.int64)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    rows = tl.load(cache + src * stride_block + offs, mask=mask)
    tl.store(cache + dst * stride_block + offs, rows, mask=mask)


def _same_layout(caches: list[torch.Tensor]) -> bool:
    first = caches[0]
    return all(
        c.dtype == first.dtype
        and c.device == first.device
        and c.shape[1:] == first.shape[1:]
        and c.stride() == first.stride()
        and c[0].is_contiguous()
        for c in caches
    )


def copy_blocks(
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy whole blocks ``src -> dst`` in every layer's K and V cache with one launch.

    Like the torch reference for disjoint src/dst sets (copy-on-write); a block that is both a
    source and a destination in one call races, where the reference reads all sources first.
    """
    caches = [*k_caches, *v_caches]
    if block_mapping.numel() == 0 or not caches:
        return
    if not _same_layout(caches):  # one pointer table needs one dtype, shape and layout
        src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
        for cache in map(torch_ref.as_bits, caches):
            cache[dst.to(cache.device)] = cache[src.to(cache.device)]
        return
    first = caches[0]
    device = first.device
    cache_ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=device)
    mapping = block_mapping.to(device).contiguous()
    block_numel = first[0].numel()
    chunk = min(COPY_CHUNK, triton.next_power_of_2(block_numel))
    grid = (len(caches), mapping.shape[0], triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        cache_ptrs,
        mapping,
        mapping.stride(0),
        block_numel,
        first.stride(0),
        WORD=_WORD_TYPES[first.element_size()],
        CHUNK=chunk,
    )


def _dst_runs(src: list[int], dst: list[int]) -> list[tuple[list[int], int]]:
    """Group pairs into runs of consecutive destination blocks: (source ids, first destination)."""
    runs: list[tuple[list[int], int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][1] + len(runs[-1][0]) == d:
            runs[-1][0].append(s)
        else:
            runs.append(([s], d))
    return runs


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Move whole blocks between devices (one layer, K or V). Copies are stream-ordered and
    asynchronous where pinned host memory allows it, so the caller syncs before reading a host
    destination from the CPU."""
    if block_mapping.numel() == 0:
        return
    src, dst = torch_ref.as_bits(src), torch_ref.as_bits(dst)
    if src.device == dst.device:
        s = block_mapping[:, 0].to(src.device, torch.long)
        d = block_mapping[:, 1].to(dst.device, torch.long)
        dst.index_copy_(0, d, src.index_select(0, s))
        return
    pairs = block_mapping.tolist()
    src_ids = [p[0] for p in pairs]
    dst_ids = [p[1] for p in pairs]
    if dst.device.type == "cpu" and dst.is_pinned():
        # device -> pinned host: one async copy per run of consecutive destination blocks, from a
        # slice when the sources are consecutive too, else from an on-device gather.
        for ids, d in _dst_runs(src_ids, dst_ids):
            n = len(ids)
            if ids == list(range(ids[0], ids[0] + n)):
                rows = src[ids[0] : ids[0] + n]
            else:
                rows = src.index_select(0, torch.tensor(ids, dtype=torch.long, device=src.device))
            dst[d : d + n].copy_(rows, non_blocking=True)
        return
    if src.device.type == "cpu":
        # host -> device: gather on the host into pinned staging, then one async upload.
        s = torch.tensor(src_ids, dtype=torch.long)
        staging = torch.empty(
            (len(src_ids), *src.shape[1:]),
            dtype=src.dtype,
            pin_memory=dst.device.type == "cuda",
        )
        torch.index_select(src, 0, s, out=staging)
        d = torch.tensor(dst_ids, dtype=torch.long, device=dst.device)
        dst.index_copy_(0, d, staging.to(dst.device, non_blocking=True))
        return
    # Anything else (device -> pageable host, device -> other device): gather, then one copy.
    s = torch.tensor(src_ids, dtype=torch.long, device=src.device)
    d = torch.tensor(dst_ids, dtype=torch.long, device=dst.device)
    dst.index_copy_(0, d, src.index_select(0, s).to(dst.device))
