"""Physical KV blocks: a ref-counted pool and per-sequence block tables.

A sequence's block table maps its logical blocks (token ``i`` lives in logical block
``i // block_size``) to physical block ids. Blocks are allocated on demand as tokens are appended,
so only a sequence's last block can hold unfilled slots.
"""
from __future__ import annotations

from collections import deque

from pagedserve.scheduler.request import Sequence


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_blocks):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free_blocks)} free")
        blocks = [self.free_blocks.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_cnt[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref_cnt[b] += 1

    def decref(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_blocks.append(b)
            elif self.ref_cnt[b] < 0:
                raise RuntimeError(f"KV block {b} freed twice")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        # New requests are admitted only while this many blocks stay free, so running ones can grow.
        self.watermark_blocks = int(watermark * num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / max(self.pool.num_blocks, 1)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_admit(self, seqs: list[Sequence], num_new_tokens: int, use_watermark: bool = True) -> bool:
        need = sum(self.blocks_needed(s, num_new_tokens) for s in seqs)
        return self.pool.num_free - need >= (self.watermark_blocks if use_watermark else 0)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block table to hold ``num_new_tokens`` more computed tokens; False if out of blocks."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.pool.num_free:
            return False
        if need:
            seq.block_table.extend(self.pool.allocate(need))
        return True

    def free(self, seq: Sequence) -> None:
        # Free in reverse so a sequence's tail blocks are reused last (helps prefix reuse later).
        self.pool.decref(seq.block_table[::-1])
        seq.block_table = []
        seq.num_sent_blocks = 0
