"""Free KV blocks kept as runs of consecutive ids, so that a sequence's blocks can lie next to each other.

Decode attention reads a sequence's blocks in table order, and reads consecutive blocks markedly faster than
scattered ones. So a growing sequence takes the block after its last one when that is free, and a new run starts in
the middle of the largest free run: that leaves room to grow both to the sequence whose blocks end before it and to
itself.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterator


class FreeRuns:
    def __init__(self, num_blocks: int, spread: bool = True) -> None:
        # spread=False starts new runs at the front of the largest free run (for pools whose tables never grow).
        self.spread = spread
        self._end: dict[int, int] = {}  # run start -> end (exclusive)
        self._start: dict[int, int] = {}  # run end -> start
        self._heap: list[tuple[int, int, int]] = []  # (-length, start, end); entries of merged runs are skipped
        self._num_free = 0
        if num_blocks:
            self._add(0, num_blocks)
            self._num_free = num_blocks

    def __len__(self) -> int:
        return self._num_free

    def __iter__(self) -> Iterator[int]:
        for s, e in self._end.items():
            yield from range(s, e)

    def take_after(self, block: int, n: int = 1) -> int:
        """Take up to ``n`` free blocks right after ``block`` (in use, so a free ``block + 1`` starts a run); how
        many were taken."""
        s = block + 1
        e = self._end.get(s)
        if e is None:
            return 0
        k = min(n, e - s)
        self._remove(s)
        if s + k < e:
            self._add(s + k, e)
        self._num_free -= k
        return k

    def take(self, n: int) -> list[int]:
        """``n`` free blocks (at most ``len(self)``) in as few runs as possible, largest runs first."""
        out: list[int] = []
        while len(out) < n:
            s, e = self._largest()
            k = min(n - len(out), e - s)
            m = s + (e - s - k) // 2 if self.spread else s
            self._remove(s)
            if s < m:
                self._add(s, m)
            if m + k < e:
                self._add(m + k, e)
            out.extend(range(m, m + k))
        self._num_free -= n
        return out

    def put(self, block: int) -> None:
        s, e = block, block + 1
        if s in self._start:  # a run ends right before the block
            s = self._start[s]
            self._remove(s)
        if e in self._end:  # and one starts right after it
            e = self._remove(e)
        self._add(s, e)
        self._num_free += 1

    def _largest(self) -> tuple[int, int]:
        while True:
            _, s, e = self._heap[0]
            if self._end.get(s) == e:
                return s, e
            heapq.heappop(self._heap)

    def _add(self, s: int, e: int) -> None:
        self._end[s] = e
        self._start[e] = s
        heapq.heappush(self._heap, (s - e, s, e))
        if len(self._heap) > 64 + 4 * len(self._end):
            self._heap = [(a - b, a, b) for a, b in self._end.items()]
            heapq.heapify(self._heap)

    def _remove(self, s: int) -> int:
        e = self._end.pop(s)
        del self._start[e]
        return e
