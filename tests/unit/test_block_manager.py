"""The block manager alone: allocation and the watermark, copy-on-write after a fork, trimming drafts, swapping a
request out and back with its sharing, the prefix cache (hits, never the last token, salts, eviction order), and the
sliding window's release; every block back in the pool at the end."""
from __future__ import annotations

from pagedserve.scheduler.block_manager import NULL_BLOCK, BlockManager
from pagedserve.scheduler.kv_events import BlockRemoved
from pagedserve.scheduler.request import Sequence

BS = 4


def _seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, index=0, token_ids=list(tokens), prompt_len=len(tokens), seed=0)


def _compute(bm: BlockManager, seq: Sequence, n: int, copies: list | None = None) -> bool:
    ok = bm.allocate_slots(seq, n, copies if copies is not None else [])
    if ok:
        seq.num_computed_tokens += n
    return ok


def test_allocation_rounds_up_and_refuses_without_change():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = _seq(0, list(range(9)))
    assert _compute(bm, a, 9) and len(a.block_table) == 3 and bm.num_free_blocks == 1
    b = _seq(1, list(range(8)))
    assert not bm.allocate_slots(b, 8, []) and b.block_table == [] and bm.num_free_blocks == 1
    bm.free(a)
    assert bm.num_free_blocks == 4 and a.block_table == []


def test_the_watermark_keeps_room_for_running_requests():
    bm = BlockManager(num_blocks=100, block_size=BS, watermark=0.05)
    assert bm.can_admit([_seq(0, list(range(95 * BS)))], 95 * BS)
    assert not bm.can_admit([_seq(0, list(range(96 * BS)))], 96 * BS)
    assert bm.can_admit([_seq(0, list(range(96 * BS)))], 96 * BS, use_watermark=False)


def test_a_fork_shares_blocks_until_one_is_written():
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = _seq(0, list(range(6)))
    assert _compute(bm, parent, 6)
    child = parent.fork(1, 1, seed=1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and bm.num_shared_blocks() == 2
    copies: list[tuple[int, int]] = []
    child.token_ids.append(99)
    assert _compute(bm, child, 1, copies)  # writes into the shared, half-full second block
    assert copies == [(parent.block_table[1], child.block_table[1])] and bm.num_copy_on_write == 1
    assert child.block_table[0] == parent.block_table[0] and bm.num_shared_blocks() == 1
    parent.token_ids.append(7)
    assert _compute(bm, parent, 1, copies) and len(copies) == 1  # the last holder writes in place
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_trim_releases_the_drafts_tail():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = _seq(0, list(range(5)))
    assert bm.allocate_slots(seq, 5 + 6, [])  # the token and 6 drafts: 3 blocks
    seq.num_computed_tokens = 6  # one draft accepted
    bm.trim(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6


def test_swap_out_and_in_keeps_a_requests_sharing():
    bm = BlockManager(num_blocks=8, block_size=BS, num_cpu_blocks=8)
    a = _seq(0, list(range(8)))
    assert _compute(bm, a, 8)
    b = a.fork(1, 1, seed=1)
    bm.fork(a, b)
    out = bm.swap_out([a, b])
    assert out is not None and len(out) == 2 and bm.num_free_blocks == 8  # two distinct blocks, copied once
    assert bm.cpu_pool.num_free == 6 and a.block_table == b.block_table
    back = bm.swap_in([a, b], 0)
    assert back is not None and len(back) == 2 and bm.num_free_blocks == 6 and bm.num_shared_blocks() == 2
    assert bm.cpu_pool.num_free == 8
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_swap_out_refuses_when_the_cpu_pool_is_too_small():
    bm = BlockManager(num_blocks=8, block_size=BS, num_cpu_blocks=1)
    a = _seq(0, list(range(8)))
    assert _compute(bm, a, 8)
    table = list(a.block_table)
    assert bm.swap_out([a]) is None and a.block_table == table and bm.num_free_blocks == 6


def test_prefix_cache_hits_full_blocks_but_never_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_caching=True)
    first = _seq(0, list(range(12)))
    assert _compute(bm, first, 12)
    bm.cache_full_blocks(first, None)
    same = _seq(1, list(range(12)))
    assert bm.match_prefix(same, None) == first.block_table[:2]  # the third block holds the last token
    longer = _seq(2, list(range(13)))
    assert bm.match_prefix(longer, None) == first.block_table
    assert bm.match_prefix(_seq(3, list(range(13))), "tenant-b") == []  # another salt shares nothing
    assert bm.match_prefix(_seq(4, [5, *range(1, 13)]), None) == []  # a different first block: no chain
    bm.take_prefix(longer, first.block_table)
    assert longer.num_computed_tokens == 12 and bm.num_shared_blocks() == 3
    bm.free(first)
    bm.free(longer)
    assert bm.num_free_blocks == 8


def test_freed_cached_blocks_are_evicted_tail_first():
    bm = BlockManager(num_blocks=3, block_size=BS, enable_caching=True)
    assert bm.take_kv_events() == []  # events are recorded from the first call on
    seq = _seq(0, list(range(12)))
    assert _compute(bm, seq, 12)
    bm.cache_full_blocks(seq, None)
    table, hashes = list(seq.block_table), list(seq.block_hashes)
    bm.free(seq)
    assert bm.num_free_blocks == 3 and len(bm.take_kv_events()) == 3  # freed but still cached
    assert _compute(bm, _seq(1, [50] * 4), 4)  # takes one block: the prefix's tail goes first
    assert bm.take_kv_events() == [BlockRemoved(hashes[2])]
    assert bm.match_prefix(_seq(2, list(range(13))), None) == table[:2]


def test_sliding_window_releases_blocks_below_it():
    bm = BlockManager(num_blocks=8, block_size=BS, sliding_window=4)
    seq = _seq(0, list(range(16)))
    assert _compute(bm, seq, 16)
    assert bm.allocate_slots(seq, 1, [])  # the next query at position 16 reads keys 13..16
    assert seq.block_table[:3] == [NULL_BLOCK] * 3 and bm.num_free_blocks == 8 - 2
    bm.free(seq)
    assert bm.num_free_blocks == 8
