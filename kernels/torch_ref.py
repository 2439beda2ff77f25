"""Torch reference ops for the paged KV cache.

These define the semantics every other backend (Triton) must reproduce exactly.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer, for K and V.
A packed batch holds ``B`` sequences; sequence ``b`` owns query rows
``query_start_loc[b]:query_start_loc[b+1]`` and has ``seq_lens[b]`` tokens of context in total
(cached prefix + the new tokens of this step, whose K/V are already written to the cache).
Query row ``i`` of sequence ``b`` sits at position ``seq_lens[b] - q_len_b + i`` and attends to
keys ``0..that position`` (causal inside the chunk, full over the cached prefix).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int, -1 = padding (skip)
) -> None:
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` cached rows of one sequence as a contiguous ``[seq_len, Hkv, D]``."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    rows = cache[block_table[:num_blocks].long()]  # [nb, bs, Hkv, D]
    return rows.reshape(-1, *cache.shape[2:])[:seq_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [q_len, Hq, D]; k, v [kv_len, Hkv, D]; causal, the queries being the last q_len positions."""
    q_len, kv_len = q.shape[0], k.shape[0]
    gqa = q.shape[1] // k.shape[1]
    if gqa > 1:
        k = k.repeat_interleave(gqa, dim=1)
        v = v.repeat_interleave(gqa, dim=1)
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if q_len == kv_len:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row per sequence. Rows with the same number of blocks attend as one padded batch,
    so padding stays under one block per row while Python work is per group, not per sequence."""
    _, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    num_blocks = (seq_lens + bs - 1) // bs
    for nb in torch.unique(num_blocks).tolist():
        rows = (num_blocks == nb).nonzero().squeeze(1)
        bt = block_tables[rows, :nb].long()
        k = k_cache[bt].view(len(rows), nb * bs, hkv, d).transpose(1, 2).to(q.dtype)
        v = v_cache[bt].view(len(rows), nb * bs, hkv, d).transpose(1, 2).to(q.dtype)
        mask = torch.arange(nb * bs, device=q.device)[None, :] < seq_lens[rows][:, None]
        o = F.scaled_dot_product_attention(q[rows].unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                           scale=scale, enable_gqa=hq != hkv)
        out[rows] = o.squeeze(2)
    return out


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    query_start_loc: torch.Tensor,  # [B + 1] int
    seq_lens: torch.Tensor,  # [B] int
    scale: float,
    out: torch.Tensor | None = None,
    decode_fn=None,
) -> torch.Tensor:
    """``decode_fn`` (same arguments as ``_decode_attention``) lets a backend replace the decode rows."""
    if out is None:
        out = torch.empty_like(query)
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    decode = query_lens == 1
    if bool(decode.any()):
        rows = decode.nonzero().squeeze(1)
        tokens = query_start_loc[:-1][rows].long()
        out[tokens] = (decode_fn or _decode_attention)(query[tokens], k_cache, v_cache, block_tables[rows],
                                                      seq_lens[rows], scale)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in (query_lens > 1).nonzero().squeeze(1).tolist():
        s, e = starts[b], starts[b + 1]
        k = gather_kv(k_cache, block_tables[b], lens[b])
        v = gather_kv(v_cache, block_tables[b], lens[b])
        out[s:e] = _attend(query[s:e], k.to(query.dtype), v.to(query.dtype), scale)
    return out


def copy_blocks(
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,  # [M, 2] (src, dst) within the same caches
) -> None:
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    for k, v in zip(k_caches, v_caches):
        k[dst] = k[src]
        v[dst] = v[src]


def swap_blocks(
    src: torch.Tensor,  # [N_src, bs, Hkv, D] (one layer, K or V)
    dst: torch.Tensor,  # [N_dst, bs, Hkv, D], possibly on another device
    block_mapping: torch.Tensor,  # [M, 2] (src block, dst block)
) -> None:
    if block_mapping.numel() == 0:
        return
    s = block_mapping[:, 0].long().to(src.device)
    d = block_mapping[:, 1].long().to(dst.device)
    dst[d] = src[s].to(dst.device)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured output's mask, as a new tensor: for each i, -inf in ``logits[rows[i]]`` at every token t whose
    bit is clear (bit t % 32 of int32 word ``bitmask[i, t // 32]``, llguidance's layout) and at the tokens past the
    mask's 32 W bits; other rows are untouched."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(2) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    if allowed.shape[1] < vocab:
        allowed = F.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    out = logits.clone()
    out[rows] = torch.where(allowed, logits[rows], float("-inf"))
    return out
