"""Sliding-window attention and logit soft-capping in the Triton kernel against the torch reference. KV blocks
wholly below the window of a sequence's first query are poisoned (NaN blocks or NULL_BLOCK entries) to prove that
neither backend reads them."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import torch_ref
from pagedserve.kernels.triton import attention as triton_attention
from pagedserve.kernels.triton import ops as triton_ops
from pagedserve.kernels.triton.attention import AttentionConfig
from pagedserve.scheduler.block_manager import NULL_BLOCK
from pagedserve.tests.engine.test_kernels_triton import BF16, F32, TOL, _attention_case

BS = 8
# Decodes before/on/after block boundaries, a chunk after a cached prefix, a chunk starting mid-block, a whole
# prompt, an idle slot.
Q_LENS = [1, 1, 1, 9, 5, 21, 0]
SEQ_LENS = [7, 16, 33, 41, 20, 21, 3]


def _poison_below_window(case: dict, q_lens: list[int], window: int, null: bool) -> int:
    """Point every table entry wholly below the window of its sequence's first query at a NaN block (or at
    NULL_BLOCK); returns how many entries were poisoned."""
    table, k_cache, v_cache = case["block_tables"], case["k_cache"], case["v_cache"]
    bs = k_cache.shape[1]
    seq_lens = case["seq_lens"].tolist()
    used = {int(x) for b, n in enumerate(seq_lens) for x in table[b, : -(-n // bs)]}
    nan_block = min(set(range(k_cache.shape[0])) - used)  # a spare block no sequence uses
    k_cache[nan_block] = float("nan")
    v_cache[nan_block] = float("nan")
    poisoned = 0
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        below = torch_ref.first_key(seq_len - q_len, window) // bs
        table[b, :below] = NULL_BLOCK if null else nan_block
        poisoned += below
    return poisoned


def _case(window: int | None, gqa: int, seed: int = 0, dtype: torch.dtype = F32, null: bool = False,
          q_lens: list[int] = Q_LENS, seq_lens: list[int] = SEQ_LENS) -> dict:
    case = _attention_case(q_lens, seq_lens, gqa=gqa, block_size=BS, head_size=32, dtype=dtype, seed=seed)
    if window is not None:
        _poison_below_window(case, q_lens, window, null)
    return case


def _compare(case: dict, window: int | None, cap: float | None, config: AttentionConfig | None = None) -> None:
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    expected = torch_ref.paged_attention(**case, **kw)
    assert not bool(expected.isnan().any())
    if config is None:
        got = triton_ops.paged_attention(**case, **kw)
    else:
        got = triton_attention.paged_attention(**case, out=torch.empty_like(case["query"]), config=config, **kw)
    torch.testing.assert_close(got, expected, **TOL[case["query"].dtype])


# Windows below one block, between blocks, equal to the longest sequence, and above every sequence.
@pytest.mark.parametrize("window", [3, 13, 41, 64])
@pytest.mark.parametrize("cap", [None, 4.0])
def test_window_and_soft_cap_mixed_batch(window: int, cap: float | None) -> None:
    case = _case(window, gqa=2, seed=window, null=window == 13)
    case["query"] *= 4  # scores large enough for the cap to matter
    _compare(case, window, cap)  # heuristic tiles
    # Several query blocks per chunk (later ones start their walk past the chunk's first window), key tiles of
    # two cache blocks.
    _compare(case, window, cap, AttentionConfig(block_q=4, tile_n=16))


@pytest.mark.parametrize("gqa", [1, 4])
def test_window_gqa_null_blocks(gqa: int) -> None:
    case = _case(10, gqa=gqa, seed=gqa, null=True)
    assert bool((case["block_tables"] == NULL_BLOCK).any())
    _compare(case, 10, 2.5)


def test_soft_cap_without_window_changes_the_output() -> None:
    case = _case(None, gqa=1, seed=7)
    case["query"] *= 8
    _compare(case, None, 1.5)
    plain = triton_ops.paged_attention(**case)
    capped = triton_ops.paged_attention(**case, logits_soft_cap=1.5)
    assert (plain - capped).abs().max() > 1e-2


@pytest.mark.parametrize(
    "config",
    [
        AttentionConfig(block_q=2, tile_n=16, num_splits=3, partition_size=16),  # some splits empty
        AttentionConfig(block_q=2, tile_n=16, num_splits=2, partition_size=16),  # the last split takes the rest
    ],
    ids=["empty_splits", "short_partitions"],
)
def test_window_split_kv(config: AttentionConfig) -> None:
    # Splits divide each program's window, not the whole context: a 60-key decode under a 40-key window.
    q_lens, seq_lens = [1, 1, 1, 3], [60, 5, 33, 50]
    case = _case(40, gqa=4, seed=3, null=True, q_lens=q_lens, seq_lens=seq_lens)
    _compare(case, 40, 3.0, config)


def test_window_bf16() -> None:
    case = _case(13, gqa=2, seed=5, dtype=BF16)
    _compare(case, 13, 4.0)


def test_window_runs_in_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    case = _case(13, gqa=2, seed=6)
    expected = torch_ref.paged_attention(**case, sliding_window=13, logits_soft_cap=4.0)

    def refuse(*args, **kwargs):
        raise AssertionError("took the torch reference")

    monkeypatch.setattr(torch_ref, "paged_attention", refuse)
    got = triton_ops.paged_attention(**case, sliding_window=13, logits_soft_cap=4.0)
    torch.testing.assert_close(got, expected, **TOL[F32])


def test_window_split_heuristic_divides_the_window() -> None:
    def config(window: int | None, max_q_len: int = 1) -> AttentionConfig:
        return triton_attention.choose_config(num_seqs=1, max_q_len=max_q_len, max_seq_len=8192, num_kv_heads=8,
                                              gqa=4, head_size=128, num_sms=132, sliding_window=window)

    full, windowed = config(None), config(4096)
    assert windowed.num_splits * windowed.partition_size >= 4096
    assert windowed.num_splits < full.num_splits or windowed.partition_size < full.partition_size
    chunk = config(4096, max_q_len=16)
    assert chunk.num_splits * chunk.partition_size >= 4096 + 15
    assert config(300).num_splits == 1  # a window too short to split


def test_bad_window_and_cap_rejected() -> None:
    case = _case(None, gqa=1)
    with pytest.raises(ValueError, match="sliding_window"):
        triton_ops.paged_attention(**case, sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        triton_ops.paged_attention(**case, logits_soft_cap=0.0)
