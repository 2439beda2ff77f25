"""Sliding-window attention and logit soft-capping: the torch reference against a naive full-mask attention, and
the C++ CPU kernels (fp32, bf16) against the torch reference, for windows below, at and above the sequence length,
on decodes, fresh prefills and chunks after a cached prefix."""
from __future__ import annotations

import math

import pytest
import torch

from pagedserve.kernels import torch_ref
from pagedserve.kernels.cpu import attention as cpu_attention
from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.tests.utils import paged_case

# Decodes at block edges, a fresh prefill, chunks after a cached prefix (one longer than a 32-row tile).
Q_LENS = [1, 1, 1, 1, 7, 20, 1, 45, 1, 3]
CTX_LENS = [0, 15, 16, 47, 0, 33, 76, 9, 200, 61]
WINDOWS = [None, 1, 5, 16, 17, 40, 64, 1000]
CAPS = [None, 2.0]


def naive(q, k_cache, v_cache, table, qsl, seq_lens, scale, window, cap):
    """Per query row, over every key of its sequence, with HF's mask: causal and ``k > p - window``."""
    out = torch.empty_like(q)
    gqa = q.shape[1] // k_cache.shape[2]
    for b in range(len(seq_lens)):
        n = int(seq_lens[b])
        k = torch_ref.gather_kv(k_cache, table[b], n).repeat_interleave(gqa, 1)  # [n, H, D]
        v = torch_ref.gather_kv(v_cache, table[b], n).repeat_interleave(gqa, 1)
        s, e = int(qsl[b]), int(qsl[b + 1])
        scores = torch.einsum("qhd,khd->hqk", q[s:e], k) * scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        p = torch.arange(n - (e - s), n)[:, None]  # query positions
        keys = torch.arange(n)[None, :]
        visible = (keys <= p) & ((keys > p - window) if window is not None else True)
        scores = scores.masked_fill(~visible, -math.inf)
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def poison_below_window(case, window):
    """Point every block-table entry wholly below a row's window at a block of NaNs (as if freed and reused)."""
    q, k, v, table, qsl, seq_lens, scale = case
    bs = k.shape[1]
    nan = torch.full_like(k[:1], math.nan)
    k, v, table = torch.cat([k, nan]), torch.cat([v, nan]), table.clone()
    for b in range(len(seq_lens)):
        first_q = int(seq_lens[b]) - int(qsl[b + 1] - qsl[b])
        table[b, :max(0, first_q - window + 1) // bs] = k.shape[0] - 1
    return q, k, v, table, qsl, seq_lens, scale


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("gqa", [1, 4])
def test_torch_ref_matches_naive(window, cap, gqa):
    case = paged_case(Q_LENS, CTX_LENS, gqa, 16, 32, torch.float32, seed=gqa, q_scale=3.0)
    want = naive(*case, window, cap)
    got = torch_ref.paged_attention(*case, sliding_window=window, logits_soft_cap=cap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    if window is not None:  # blocks below the window are never read
        got = torch_ref.paged_attention(*poison_below_window(case, window), sliding_window=window, logits_soft_cap=cap)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1, 5, 16, 17, 40, 1000])
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("gqa,head_size,block_size", [(1, 64, 16), (4, 32, 8)])
def test_cpu_kernel_matches_torch_ref(dtype, window, cap, gqa, head_size, block_size):
    if not cpu_extension.available():
        pytest.skip("C++ kernels not built")
    # Besides Q_LENS: a decode of 700 keys (split into parts) and a 17-row prefill (a 1-row last tile under MQA).
    case = paged_case([*Q_LENS, 1, 17], [*CTX_LENS, 699, 30], gqa, block_size, head_size, dtype, seed=gqa + head_size,
                      q_scale=3.0)
    if window is not None:
        case = poison_below_window(case, window)
    q, k, v, *rest = case
    want = torch_ref.paged_attention(q.float(), k.float(), v.float(), *rest, sliding_window=window,
                                     logits_soft_cap=cap)
    got = cpu_attention.paged_attention(*case, sliding_window=window, logits_soft_cap=cap)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)
