"""Batched sampling: penalties, min_tokens, temperature, top-k / top-p / min-p, greedy or random.

Random draws come from a counter-based hash of (seed, output index), one uniform per row, turned
into a token by inverse-CDF. A request's samples therefore depend only on its seed and on how many
tokens it has produced: not on the batch it shares, not on preemption, not on the TP rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.worker.forward_context import current_backend

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer finalizer; constants < 2**27 keep every product inside int64.
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def hashed_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One float64 in (0, 1) per row from int64 seeds and counters."""
    key = _mix32(_mix32(seeds & _MASK32) ^ _mix32((seeds >> 32) & _MASK32) ^ (counters & _MASK32))
    key = _mix32(key ^ 0x5BD1E995)
    return (key.double() + 0.5) / 2.0**32


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32, 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, vocab size where unused
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    seeds: torch.Tensor  # [B] int64
    counters: torch.Tensor  # [B] int64: index of the token being sampled
    # Penalties (None if no row uses them): per row, and padded token id lists (-1 = pad).
    repetition_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    prompt_tokens: torch.Tensor | None = None  # [B, Lp]
    output_tokens: torch.Tensor | None = None  # [B, Lo]
    # (row, token id) pairs banned this step (stop tokens before min_tokens is reached).
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    # Structured output: (rows, their int32 token bitmasks [R, W]; see kernels/torch_ref.apply_token_bitmask).
    token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None
    max_num_logprobs: int = -1  # -1: no row wants logprobs
    # The rows whose logprobs are wanted, when not all are; the others' read 0 (logprob, top) and rank 1.
    logprob_rows: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B]
    logprobs: torch.Tensor | None  # [B] raw logprob of the sampled token
    top_ids: torch.Tensor | None  # [B, K]
    top_logprobs: torch.Tensor | None
    ranks: torch.Tensor | None  # [B] rank of the sampled token (1 = best)


def _token_counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    counts = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.int32, device=tokens.device)
    idx = torch.where(tokens < 0, vocab, tokens)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.int32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    vocab = logits.shape[1]
    out_counts = _token_counts(md.output_tokens, vocab)
    seen = (_token_counts(md.prompt_tokens, vocab) + out_counts) > 0
    rep = md.repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - md.frequency_penalty.unsqueeze(1) * out_counts
    return logits - md.presence_penalty.unsqueeze(1) * (out_counts > 0)


def sample(logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    """Through the forward context's kernel backend."""
    backend = current_backend()
    logits = logits.float()
    raw = logits
    if md.token_bitmask is not None:
        logits = backend.apply_token_bitmask(logits, *md.token_bitmask)
    if md.repetition_penalty is not None:
        logits = apply_penalties(logits, md)
    if md.banned is not None:
        logits = logits.index_put(md.banned, torch.tensor(float("-inf"), device=logits.device))
    greedy = backend.argmax(logits)
    if md.all_greedy:
        token_ids = greedy
    else:
        u = hashed_uniform(md.seeds, md.counters)
        token_ids = backend.sample_rows(logits, md.temperature, md.top_k, md.top_p, md.min_p, u, greedy)
    if md.max_num_logprobs < 0:
        return SamplerOutput(token_ids, None, None, None, None)
    rows = md.logprob_rows
    # A [rows, vocab] fp32 pass or three: only over the rows that asked (one logprobs request in a wide batch).
    logprobs = torch.log_softmax(raw if rows is None else raw[rows], dim=1)
    chosen = logprobs.gather(1, (token_ids if rows is None else token_ids[rows]).unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_lp, top_ids = logprobs.topk(md.max_num_logprobs, dim=1) if md.max_num_logprobs > 0 else (None, None)
    chosen = chosen.squeeze(1)
    if rows is not None:
        chosen, ranks = _scatter_rows(chosen, rows, len(token_ids)), _scatter_rows(ranks, rows, len(token_ids), 1)
        if top_lp is not None:
            top_lp, top_ids = _scatter_rows(top_lp, rows, len(token_ids)), _scatter_rows(top_ids, rows, len(token_ids))
    return SamplerOutput(token_ids, chosen, top_ids, top_lp, ranks)


def _scatter_rows(x: torch.Tensor, rows: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    """``x``'s rows at ``rows`` of an ``n``-row tensor, ``fill`` elsewhere."""
    out = torch.full((n, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
    out[rows] = x
    return out
