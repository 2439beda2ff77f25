"""Paged attention in Triton: one kernel for a packed batch of prefill chunks and decodes.

Grid of the main kernel: ``(num_q_blocks, num_kv_heads, num_splits)``. A program owns ``BLOCK_Q``
query tokens of one sequence and all ``GQA`` query heads that share one KV head, so its tile has
``BLOCK_M = BLOCK_Q * GQA_PAD`` rows (token-major) and every K/V tile is loaded once for the whole
group. It walks the sequence's keys ``TILE_N`` at a time through the block table (each row of a
tile looks up its own physical block, so ``TILE_N`` need not equal the cache block size) with an
online softmax in fp32.

A sliding window (``SLIDING``) raises the start of that walk to the lowest key the block's first
query sees, so blocks wholly below it are never loaded (their table entries may be freed,
``NULL_BLOCK``); each row also masks the keys below its own window. A logit soft-cap
(``SOFT_CAP``) squashes the scores before the online softmax.

With ``num_splits > 1`` (flash-decoding) split ``s`` only covers keys
``[kv_lo + s * partition_size, kv_lo + (s + 1) * partition_size)`` of the program's key range
``[kv_lo, kv_end)`` (``kv_lo`` is 0 without a window, so splits only divide the window) and writes an
fp32 partial output plus its log2-sum-exp; ``_reduce_splits_kernel`` then merges the partials of
each (token, head), where an empty split weighs nothing.

Query blocks are numbered so that sequence ``b`` starts at ``query_start_loc[b] // BLOCK_Q + b``;
that keeps the starts strictly increasing, bounds the grid by ``num_tokens // BLOCK_Q + num_seqs``
without a host pass over the batch, and lets a program find its sequence by binary search.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

# Split-KV (flash-decoding) kicks in when the batch has fewer programs than this many per SM,
# every sequence has at most SPLIT_MAX_Q_LEN new tokens and some context is long enough to be
# worth at least two partitions of MIN_PARTITION keys.
SPLIT_PROGRAMS_PER_SM = 2
SPLIT_MAX_Q_LEN = 64
MIN_PARTITION = 256
MAX_SPLITS = 64


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest ``b`` with ``query_start_loc[b] // BLOCK_Q + b <= q_block_id``."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _mma(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    # The interpreter multiplies bf16 bit patterns in tl.dot (triton#11584): go through fp32.
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _tanh(x):
    # exp2 form: no libdevice in the interpreter; e in (0, 1] never overflows.
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D], or fp32 [S, T, Hq, D] partials when SPLIT
    lse_ptr,  # fp32 [S, T, Hq] log2-sum-exp of each partial (only read when SPLIT)
    query_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [N, bs, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks]
    query_start_loc_ptr,  # [B + 1]
    seq_lens_ptr,  # [B]
    scale_log2,  # softmax scale * log2(e) (* an fp8 K cache's scale): the softmax runs on exp2
    v_scale,  # an fp8 V cache's scale (1.0 else), applied to the output
    soft_cap_log2,  # logit soft-cap * log2(e) (only read when SOFT_CAP)
    sliding_window,  # a query at position p sees keys > p - sliding_window (only read when SLIDING)
    num_seqs,
    partition_size,  # keys per split, a multiple of TILE_N
    stride_q_tok,
    stride_q_head,
    stride_o_split,
    stride_o_tok,
    stride_o_head,
    stride_lse_split,
    stride_lse_tok,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GQA: tl.constexpr,
    GQA_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq_idx(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GQA_PAD
    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GQA_PAD  # query index inside the sequence
    head_in_group = rows % GQA_PAD
    row_valid = (tok < q_len) & (head_in_group < GQA)
    q_head = kv_head * GQA + head_in_group
    q_pos = prefix_len + tok
    q_row = (q_start + tok).to(tl.int64)

    d = tl.arange(0, HEAD_PAD)
    d_valid = d < HEAD_SIZE
    q = tl.load(
        query_ptr + q_row[:, None] * stride_q_tok + q_head[:, None] * stride_q_head + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )

    # Keys past the last query position of this block are masked for every row: skip them.
    kv_end = tl.minimum(seq_len, prefix_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len))
    # Keys below the window of the block's first query are masked for every row: never load them.
    if SLIDING:
        kv_lo = tl.maximum(prefix_len + q_block * BLOCK_Q - sliding_window + 1, 0)
    else:
        kv_lo = 0
    if SPLIT:
        kv_start = kv_lo + split * partition_size
        kv_stop = tl.minimum(kv_end, kv_start + partition_size)
        if split == tl.num_programs(2) - 1:
            kv_stop = kv_end  # the last split takes any rest, so no key is ever dropped
    else:
        kv_start = kv_lo
        kv_stop = kv_end

    # A finite start for the running max keeps fully masked rows free of inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile_start in range(kv_start, kv_stop, TILE_N):
        j = tile_start + tl.arange(0, TILE_N)
        j_valid = j < kv_stop
        block = tl.load(bt_row + j // BLOCK_SIZE, mask=j_valid, other=0).to(tl.int64)
        slot = j % BLOCK_SIZE

        k_off = block * stride_k_block + slot * stride_k_slot + kv_head * stride_k_head
        k = tl.load(
            k_cache_ptr + k_off[None, :] + d[:, None],
            mask=j_valid[None, :] & d_valid[:, None],
            other=0.0,
        ).to(q.dtype)
        s = _mma(q, k, DOT_PRECISION, UPCAST_DOT) * scale_log2
        if SOFT_CAP:
            s = soft_cap_log2 * _tanh(s / soft_cap_log2)
        seen = (j[None, :] <= q_pos[:, None]) & j_valid[None, :]
        if SLIDING:
            seen = seen & (j[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(seen, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_off = block * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head
        v = tl.load(
            v_cache_ptr + v_off[:, None] + d[None, :],
            mask=j_valid[:, None] & d_valid[None, :],
            other=0.0,
        ).to(q.dtype)
        acc = acc * alpha[:, None] + _mma(p.to(q.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new

    has_keys = l_i > 0.0  # false for padding rows and for rows with no key in this split
    acc = acc * (v_scale / tl.where(has_keys, l_i, 1.0))[:, None]
    out_mask = row_valid[:, None] & d_valid[None, :]
    if SPLIT:
        o_ptrs = (
            out_ptr
            + split * stride_o_split
            + q_row[:, None] * stride_o_tok
            + q_head[:, None] * stride_o_head
            + d[None, :]
        )
        tl.store(o_ptrs, acc, mask=out_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        lse_ptrs = lse_ptr + split * stride_lse_split + q_row * stride_lse_tok + q_head
        tl.store(lse_ptrs, lse, mask=row_valid)
    else:
        o_ptrs = out_ptr + q_row[:, None] * stride_o_tok + q_head[:, None] * stride_o_head + d[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _reduce_splits_kernel(
    out_ptr,  # [T, Hq, D]
    partial_ptr,  # fp32 [S, T, Hq, D]
    lse_ptr,  # fp32 [S, T, Hq]
    num_splits,
    stride_o_tok,
    stride_o_head,
    stride_p_split,
    stride_p_tok,
    stride_p_head,
    stride_lse_split,
    stride_lse_tok,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_valid = s < num_splits
    d = tl.arange(0, HEAD_PAD)
    d_valid = d < HEAD_SIZE

    lse = tl.load(
        lse_ptr + s * stride_lse_split + tok * stride_lse_tok + head,
        mask=s_valid,
        other=float("-inf"),
    )
    # A split with no key for this row has lse -inf and weighs 0; some split holds the row's own key.
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.where(s_valid & (lse > float("-inf")), tl.exp2(lse - lse_max), 0.0)
    partial = tl.load(
        partial_ptr
        + s[:, None] * stride_p_split
        + tok * stride_p_tok
        + head * stride_p_head
        + d[None, :],
        mask=s_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    total = tl.sum(weight, axis=0)
    o = tl.sum(partial * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + tok * stride_o_tok + head * stride_o_head + d,
        o.to(out_ptr.dtype.element_ty),
        mask=d_valid,
    )


@dataclass(frozen=True)
class AttentionConfig:
    block_q: int  # query tokens per program (rows = block_q * gqa_pad)
    tile_n: int  # keys per inner-loop step
    num_splits: int = 1
    partition_size: int = 0  # keys per split; only meaningful when num_splits > 1
    num_warps: int = 4
    num_stages: int = 2


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def choose_config(
    *,
    num_seqs: int,
    max_q_len: int,
    max_seq_len: int,
    num_kv_heads: int,
    gqa: int,
    head_size: int,
    num_sms: int,
    on_gpu: bool = True,
    dtype_bytes: int = 2,
    sliding_window: int | None = None,
) -> AttentionConfig:
    """Tile sizes and the split-KV decision for one call. Splits divide the keys one program
    walks: the whole context, or under a sliding window at most ``window + max_q_len - 1`` keys."""
    gqa_pad = triton.next_power_of_2(gqa)
    # tl.dot wants >= 16 rows; a decode program holds one token, so its rows are the GQA group.
    # 128-row tiles only for 16-bit inputs: fp32 ones would need ~160 KB of shared memory.
    big_tiles = on_gpu and head_size <= 128 and dtype_bytes == 2
    max_rows = 128 if big_tiles and max_q_len * gqa_pad >= 128 else 64
    rows = max(16, gqa_pad, min(max_rows, triton.next_power_of_2(max_q_len) * gqa_pad))
    block_q = max(1, rows // gqa_pad)
    tile_n = 64
    num_warps = 8 if rows >= 128 else 4
    num_stages = 2 if rows >= 128 else 3
    if triton.next_power_of_2(head_size) * dtype_bytes > 256:  # fp32 above 64, or 16-bit 256
        tile_n, num_stages = 32, 2

    kv_span = max_seq_len
    if sliding_window is not None:
        kv_span = min(kv_span, sliding_window + max_q_len - 1)
    num_splits, partition_size = 1, 0
    programs = num_seqs * num_kv_heads * triton.cdiv(max_q_len, block_q)
    if (
        max_q_len <= SPLIT_MAX_Q_LEN
        and programs < SPLIT_PROGRAMS_PER_SM * num_sms
        and kv_span >= 2 * MIN_PARTITION
    ):
        wanted = triton.cdiv(SPLIT_PROGRAMS_PER_SM * num_sms, programs)
        num_splits = min(wanted, kv_span // MIN_PARTITION, MAX_SPLITS)
        if num_splits > 1:
            partition_size = triton.cdiv(triton.cdiv(kv_span, num_splits), tile_n) * tile_n
            num_splits = triton.cdiv(kv_span, partition_size)
        if num_splits <= 1:
            num_splits, partition_size = 1, 0
    return AttentionConfig(block_q, tile_n, num_splits, partition_size, num_warps, num_stages)


def batch_stats(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> tuple[int, int, int]:
    """(max_q_len, max_seq_len, num_tokens) with a single device-to-host sync."""
    if seq_lens.numel() == 0:
        return 0, 0, 0
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    stats = torch.stack([q_lens.max(), seq_lens.max().to(q_lens.dtype), query_start_loc[-1]])
    max_q_len, max_seq_len, num_tokens = stats.tolist()
    return max_q_len, max_seq_len, num_tokens


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    config: AttentionConfig | None = None,
    stats: tuple[int, int, int] | None = None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Launch for checked arguments (see ``ops.paged_attention``). ``config`` overrides the
    heuristic (tests use it to reach every tiling and the split path on tiny shapes); ``stats``
    is ``batch_stats(...)`` when the caller already knows it, saving the device-to-host sync.
    ``sliding_window`` (>= 1), ``logits_soft_cap`` (> 0) and an fp8 cache's scales follow
    ``torch_ref.paged_attention``."""
    if k_cache.element_size() != 1:
        k_scale = v_scale = 1.0
    _, num_q_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    gqa = num_q_heads // num_kv_heads
    max_q_len, max_seq_len, num_tokens = stats or batch_stats(query_start_loc, seq_lens)
    if num_tokens == 0 or max_q_len == 0:
        return out
    if config is None:
        config = choose_config(
            num_seqs=num_seqs,
            max_q_len=max_q_len,
            max_seq_len=max_seq_len,
            num_kv_heads=num_kv_heads,
            gqa=gqa,
            head_size=head_size,
            num_sms=_num_sms(query.device),
            on_gpu=query.device.type == "cuda" and not _interpreting(),
            dtype_bytes=query.element_size(),
            sliding_window=sliding_window,
        )
    head_pad = triton.next_power_of_2(head_size)
    split = config.num_splits > 1
    grid = (num_tokens // config.block_q + num_seqs, num_kv_heads, config.num_splits)
    if split:
        partial = torch.empty(
            (config.num_splits, num_tokens, num_q_heads, head_size),
            dtype=torch.float32,
            device=query.device,
        )
        lse = torch.empty(
            (config.num_splits, num_tokens, num_q_heads), dtype=torch.float32, device=query.device
        )
        dst, dst_strides = partial, partial.stride()[:3]
        lse_strides = lse.stride()[:2]
    else:
        lse = out  # unused by the kernel
        dst, dst_strides = out, (0, *out.stride()[:2])
        lse_strides = (0, 0)
    _paged_attention_kernel[grid](
        dst,
        lse,
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * k_scale * math.log2(math.e),
        v_scale,
        (logits_soft_cap or 1.0) * math.log2(math.e),
        sliding_window or 0,
        num_seqs,
        config.partition_size,
        query.stride(0),
        query.stride(1),
        *dst_strides,
        *lse_strides,
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        GQA=gqa,
        GQA_PAD=triton.next_power_of_2(gqa),
        BLOCK_Q=config.block_q,
        TILE_N=config.tile_n,
        SPLIT=split,
        SLIDING=sliding_window is not None,
        SOFT_CAP=logits_soft_cap is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        UPCAST_DOT=_interpreting() and query.dtype == torch.bfloat16,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split:
        _reduce_splits_kernel[(num_tokens, num_q_heads)](
            out,
            partial,
            lse,
            config.num_splits,
            out.stride(0),
            out.stride(1),
            *partial.stride()[:3],
            *lse.stride()[:2],
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            SPLITS_PAD=triton.next_power_of_2(config.num_splits),
            num_warps=4,
        )
    return out
