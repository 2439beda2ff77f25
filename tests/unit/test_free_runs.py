"""The free-block runs (scheduler/free_runs.py) and the block tables they give: growing sequences stay consecutive."""
from __future__ import annotations

import random

from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.free_runs import FreeRuns
from pagedserve.scheduler.request import Sequence


def runs(free: FreeRuns) -> list[tuple[int, int]]:
    blocks = sorted(free)
    out: list[tuple[int, int]] = []
    for b in blocks:
        if out and out[-1][1] == b:
            out[-1] = (out[-1][0], b + 1)
        else:
            out.append((b, b + 1))
    return out


def test_new_runs_start_mid_way_in_the_largest_free_run_and_grow_after_their_last_block() -> None:
    free = FreeRuns(100)
    a = free.take(10)
    assert a == list(range(45, 55))  # room on both sides
    b = free.take(4)
    assert b == list(range(20, 24))  # the middle of [0, 45), the larger of the two runs left
    assert free.take_after(a[-1]) and free.take_after(b[-1])  # 55 and 24 were free
    assert not free.take_after(a[0])  # 46 is in use
    assert len(free) == 100 - 16 and runs(free) == [(0, 20), (25, 45), (56, 100)]


def test_put_merges_neighbours_back_into_one_run() -> None:
    free = FreeRuns(32)
    taken = free.take(32)
    assert sorted(taken) == list(range(32)) and len(free) == 0
    for b in [3, 5, 4, 0, 31, 1, 2]:
        free.put(b)
    assert runs(free) == [(0, 6), (31, 32)]
    assert free.take(7) == [0, 1, 2, 3, 4, 5, 31]  # largest run first, then the next
    assert len(free) == 0


def test_random_takes_and_puts_match_a_set() -> None:
    rng = random.Random(0)
    n = 300
    free, ref = FreeRuns(n), set(range(n))
    held: list[int] = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 and ref:
            k = rng.randint(1, min(12, len(ref)))
            got = free.take(k)
            assert len(got) == len(set(got)) == k and set(got) <= ref
            ref -= set(got)
            held += got
        elif op < 0.6 and held:
            b = rng.choice(held)
            if free.take_after(b):
                assert b + 1 in ref
                ref.discard(b + 1)
                held.append(b + 1)
            else:
                assert b + 1 not in ref
        elif held:
            b = held.pop(rng.randrange(len(held)))
            free.put(b)
            ref.add(b)
        assert len(free) == len(ref)
    assert set(free) == ref and sum(e - s for s, e in runs(free)) == len(ref)


def test_interleaved_decodes_keep_each_block_table_consecutive() -> None:
    """Sequences that each grow a block at a time, in turn, as decodes of one batch do: with the old first-free
    order their blocks interleaved (a, b, c, a, b, c, ...)."""
    bm = BlockManager(num_blocks=256, block_size=4)
    seqs = [Sequence(seq_id=i, index=0, token_ids=list(range(10)), prompt_len=10, seed=0) for i in range(3)]
    for s in seqs:
        assert bm.allocate_slots(s, 10)
        s.num_computed_tokens = 10
    for _ in range(40):
        for s in seqs:
            assert bm.allocate_slots(s, 1)
            s.num_computed_tokens += 1
    for s in seqs:
        assert len(s.block_table) == 13
        assert s.block_table == list(range(s.block_table[0], s.block_table[0] + 13))
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == 256 and runs(bm.pool.free_blocks) == [(0, 256)]
