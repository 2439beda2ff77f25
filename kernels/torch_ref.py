"""Torch reference ops, the executable spec of every kernel: the paged KV cache and attention, the element-wise ops
(RMSNorm, rotary, SiLU-and-mul, row gathers), sampling, and the weight-only int8 linear.

These define the semantics every other backend (C++, Triton) must reproduce exactly; the torch backend runs them.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer, for K and V.
A packed batch holds ``B`` sequences; sequence ``b`` owns query rows
``query_start_loc[b]:query_start_loc[b+1]`` and has ``seq_lens[b]`` tokens of context in total
(cached prefix + the new tokens of this step, whose K/V are already written to the cache).
Query row ``i`` of sequence ``b`` sits at position ``seq_lens[b] - q_len_b + i`` and attends to
keys ``0..that position`` (causal inside the chunk, full over the cached prefix), or with a sliding window ``W``
only the last ``W`` of them (positions ``> position - W``, Hugging Face's convention for every family).

An fp8 cache (``float8_e4m3fn`` or ``float8_e5m2``) holds ``key / k_scale`` (``value / v_scale``) saturated to the
format's finite range and rounded to nearest even; attention reads ``cached * k_scale`` (per-tensor scales, one
pair per layer). Caches of any other dtype ignore the scales.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in FP8_DTYPES


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its bytes (torch's CPU index ops do not take fp8); any other tensor as it is."""
    return t.view(torch.uint8) if is_fp8(t) else t


def quantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` saturated to ``dtype``'s finite range, rounded to nearest even."""
    bound = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-bound, bound).to(dtype)


def dequantize(cached: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as ``dtype`` for attention: fp8 bytes times their scale, other caches converted."""
    if not is_fp8(cached):
        return cached.to(dtype)
    return (cached.float() * scale).to(dtype)


def to_cache(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows as the cache stores them."""
    return quantize_fp8(x, scale, cache.dtype) if is_fp8(cache) else x.to(cache.dtype)


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int, -1 = padding (skip)
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    slots = slot_mapping.long()
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        rows = as_bits(to_cache(x, cache, scale))
        as_bits(cache).view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` cached rows of one sequence as a contiguous ``[seq_len, Hkv, D]`` (in the cache's
    dtype)."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    rows = as_bits(cache)[block_table[:num_blocks].long()].view(cache.dtype)  # [nb, bs, Hkv, D]
    return rows.reshape(-1, *cache.shape[2:])[:seq_len]


def first_key(pos, sliding_window: int | None):
    """The lowest key position a query at ``pos`` (an int or a tensor of them) attends: HF's
    ``kv_idx > q_idx - sliding_window``."""
    if sliding_window is None:
        return pos * 0
    lo = pos - sliding_window + 1
    return lo.clamp(min=0) if isinstance(lo, torch.Tensor) else max(0, lo)


def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                       logits_soft_cap: float | None) -> torch.Tensor:
    """q [..., Hq, M, D]; k, v [..., Hkv, N, D]; mask (True = attend) broadcasts to [..., Hq, M, N]."""
    if logits_soft_cap is None:
        gqa = q.shape[-3] != k.shape[-3]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    gqa = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(gqa, dim=-3), v.repeat_interleave(gqa, dim=-3)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_start: int, k_start: int,
            sliding_window: int | None, logits_soft_cap: float | None) -> torch.Tensor:
    """q [q_len, Hq, D] at positions ``q_start..``; k, v [kv_len, Hkv, D] at positions ``k_start..``."""
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if q_start == k_start == 0 and sliding_window is None and logits_soft_cap is None:
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa).transpose(0, 1)
    q_pos = torch.arange(q_start, q_start + q.shape[0], device=q.device)[:, None]
    k_pos = torch.arange(k_start, k_start + k.shape[0], device=q.device)[None, :]
    mask = (k_pos <= q_pos) & (k_pos >= first_key(q_pos, sliding_window))
    return _softmax_attention(qt, kt, vt, mask, scale, logits_soft_cap).transpose(0, 1)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, sliding_window: int | None,
                      logits_soft_cap: float | None, k_scale: float, v_scale: float) -> torch.Tensor:
    """One query row per sequence, at position ``seq_len - 1``. Each row reads its blocks from the one holding its
    first key; rows spanning the same number of blocks attend as one padded batch, so padding stays under one
    block per row while Python work is per group, not per sequence."""
    d = q.shape[2]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    lo = first_key(seq_lens - 1, sliding_window)  # first key position per row
    first_block = lo // bs
    num_blocks = (seq_lens + bs - 1) // bs - first_block
    for nb in torch.unique(num_blocks).tolist():
        rows = (num_blocks == nb).nonzero().squeeze(1)
        cols = first_block[rows][:, None] + torch.arange(nb, device=q.device)
        bt = block_tables[rows].gather(1, cols.to(block_tables.dtype)).long()
        k = as_bits(k_cache)[bt].view(k_cache.dtype).view(len(rows), nb * bs, hkv, d).transpose(1, 2)
        v = as_bits(v_cache)[bt].view(v_cache.dtype).view(len(rows), nb * bs, hkv, d).transpose(1, 2)
        k, v = dequantize(k, k_scale, q.dtype), dequantize(v, v_scale, q.dtype)
        pos = (first_block[rows] * bs)[:, None] + torch.arange(nb * bs, device=q.device)
        mask = (pos < seq_lens[rows][:, None]) & (pos >= lo[rows][:, None])
        o = _softmax_attention(q[rows].unsqueeze(2), k, v, mask[:, None, None, :], scale, logits_soft_cap)
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
    *,
    sliding_window: int | None = None,  # a query at position p attends keys at positions > p - sliding_window
    logits_soft_cap: float | None = None,  # scores = cap * tanh(scores / cap) before the softmax
    k_scale: float = 1.0,  # fp8 caches: what a cached byte's value is multiplied by
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Block-table entries wholly below a row's window are never read (they may point at freed blocks)."""
    if out is None:
        out = torch.empty_like(query)
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    decode = query_lens == 1
    if bool(decode.any()):
        rows = decode.nonzero().squeeze(1)
        tokens = query_start_loc[:-1][rows].long()
        out[tokens] = _decode_attention(query[tokens], k_cache, v_cache, block_tables[rows], seq_lens[rows].long(),
                                        scale, sliding_window, logits_soft_cap, k_scale, v_scale)
    bs = k_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in (query_lens > 1).nonzero().squeeze(1).tolist():
        s, e = starts[b], starts[b + 1]
        q_start = lens[b] - (e - s)
        k_start = first_key(q_start, sliding_window) // bs * bs
        k = gather_kv(k_cache, block_tables[b, k_start // bs:], lens[b] - k_start)
        v = gather_kv(v_cache, block_tables[b, k_start // bs:], lens[b] - k_start)
        out[s:e] = _attend(query[s:e], dequantize(k, k_scale, query.dtype), dequantize(v, v_scale, query.dtype),
                           scale, q_start, k_start, sliding_window, logits_soft_cap)
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
        k, v = as_bits(k), as_bits(v)
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
    as_bits(dst)[d] = as_bits(src)[s].to(dst.device)


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


def _filter(probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
            min_p: torch.Tensor | None) -> torch.Tensor:
    """Zero out tokens outside min-p, top-k and top-p (each row with its own settings)."""
    if min_p is not None:
        probs = probs * (probs >= min_p.unsqueeze(1) * probs.max(dim=1, keepdim=True).values)
    if top_k is None and top_p is None:
        return probs
    # Ties in p by token id (what the C++ kernel does; a plain sort leaves them in any order).
    order = torch.sort(probs, dim=1, descending=True, stable=True).indices
    sorted_p = probs.gather(1, order)
    drop = torch.zeros_like(sorted_p, dtype=torch.bool)
    if top_k is not None:
        drop |= torch.arange(probs.shape[1], device=probs.device)[None, :] >= top_k[:, None]
    if top_p is not None:
        # Mass strictly before each token; keep tokens until it reaches top_p of the (kept) total.
        kept = sorted_p.masked_fill(drop, 0.0)
        before = kept.cumsum(dim=1) - kept
        drop |= before >= top_p[:, None] * kept.sum(dim=1, keepdim=True)
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, min_p: torch.Tensor | None, uniform: torch.Tensor,
                greedy: torch.Tensor) -> torch.Tensor:
    """One token per row of fp32 ``logits`` [B, V]: where ``temperature`` > 0, drawn from softmax(logits /
    temperature) after min-p (tokens under min_p x the top probability weigh 0), top-k and top-p (in order of
    probability, ties by token id: a token stays while the kept mass before it is under top_p of the kept total) as
    the first token whose fp64 cumulative kept mass exceeds ``uniform`` (in (0, 1)) times the total; elsewhere
    ``greedy``'s. ``top_k``, ``top_p``, ``min_p``: None where no row uses them."""
    temp = torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
    probs = _filter(torch.softmax(logits / temp, dim=1), top_k, top_p, min_p)
    cdf = probs.double().cumsum(dim=1)
    u = uniform.to(cdf.device) * cdf[:, -1]
    drawn = torch.searchsorted(cdf, u.unsqueeze(1), right=True).squeeze(1).clamp_(max=logits.shape[1] - 1)
    return torch.where(temperature > 0, drawn, greedy)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of ``weight [N, K]``: ``q = round(w / scale)`` (to nearest even) with
    ``scale = absmax(row) / 127`` in fp32 (1 for an all-zero row), so that ``q * scale`` is the dequantized weight."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Weight-only int8 linear: ``(x @ q.T) * scale + bias`` for int8 ``weight [N, K]`` and fp32 ``scale [N]``,
    summed in fp32 and rounded once to ``out_dtype`` (default: x's dtype): what the dequantized model computes."""
    y = F.linear(x.float(), weight.float()) * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dim, normalized in fp32 and rounded to x's dtype before
    the weight multiplies (LLaMA's order)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: a decoder layer's norm and its new residual. The C++ kernel writes
    both in place over ``x`` and ``residual``; callers use the returned pair."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style rotary on the first ``rotary_dim`` of each head of ``q [T, Hq, D]`` and ``k [T, Hkv, D]``, the
    pairs ``(x[i], x[i + rotary_dim / 2])`` turned by the angles of ``cos``/``sin [max_pos, rotary_dim / 2]``
    (fp32) at each token's position, in q's dtype. The C++ kernel rotates in place; callers use the returned pair."""
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)

    def turn(x: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out

    return turn(q), turn(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x [..., 2I]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gather_rows(src: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``src[ids]`` for ``src [V, H]`` and int64 ids of any shape (an embedding lookup)."""
    return F.embedding(ids, src)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum of ``x [B, V]``."""
    return x.argmax(dim=1)


@dataclass
class ExpertRouting:
    weights: torch.Tensor  # [tokens, top_k] float32
    experts: torch.Tensor  # [tokens, top_k] int64, in order of decreasing weight


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> ExpertRouting:
    """A MoE router's choice: softmax over all experts in fp32, then top-k; ``renormalize`` rescales the k weights
    to sum to 1 (Mixtral always, which equals a softmax over the top-k logits; Qwen3-MoE when ``norm_topk_prob``)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ExpertRouting(weights, experts)


def fused_moe(x: torch.Tensor, w13: list[torch.Tensor], w2: list[torch.Tensor], topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, expert_start: int = 0, w13_scale: list[torch.Tensor] | None = None,
              w2_scale: list[torch.Tensor] | None = None) -> torch.Tensor:
    """One rank's share of a SwiGLU MoE layer: ``sum_k topk_weights[t, k] * expert(x[t])`` over the choices k whose
    expert is one of this rank's, ``expert_start + i`` for ``w13[i] [2I, H]`` (gate rows, then up rows) and
    ``w2[i] [H, I]``; the others add nothing. Each expert runs once on its tokens (in token order), its outputs
    weighted in fp32 and summed over k in k order, in x's dtype at the end. With scales, the weights are int8 and
    each projection is :func:`int8_linear`."""
    def linear(h: torch.Tensor, i: int, weights: list[torch.Tensor], scales: list[torch.Tensor] | None):
        return F.linear(h, weights[i]) if scales is None else int8_linear(h, weights[i], scales[i])

    per_choice = torch.zeros(*topk_ids.shape, x.shape[-1], dtype=torch.float32, device=x.device)
    for i in range(len(w13)):
        tokens, choices = (topk_ids == expert_start + i).nonzero(as_tuple=True)
        if tokens.numel():
            y = linear(silu_and_mul(linear(x[tokens], i, w13, w13_scale)), i, w2, w2_scale)
            per_choice[tokens, choices] = y.float() * topk_weights[tokens, choices, None].float()
    out = per_choice[:, 0]
    for k in range(1, topk_ids.shape[1]):
        out = out + per_choice[:, k]
    return out.to(x.dtype)
