"""Physical KV blocks: a ref-counted pool with a prefix cache, and per-sequence block tables.

A sequence's block table maps its logical blocks (token ``i`` lives in logical block
``i // block_size``) to physical block ids. Blocks are allocated on demand as tokens are appended,
so only a sequence's last block can hold unfilled slots. Blocks are shared by reference count
(forked sequences, cached prefixes); a shared block that is about to be written is copied first.

Prefix caching: once a full block's KV is computed it is registered under a hash chained to its
parent's (and to the request's ``cache_salt``). A lookup also checks the block's token ids and that
its parent is the very cache entry matched one level up, so even a hash collision can never serve
wrong KV. Unreferenced cached blocks wait in an LRU evictor and are reclaimed only when no plain
free block is left.

Sliding window: where every layer of the model slides (``sliding_window`` set), the blocks wholly below the window
of a sequence's next query are released as it grows; their table entries become ``NULL_BLOCK`` (kept so that
token ``i`` stays in entry ``i // block_size``), which the attention kernels never read.
"""
from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass

from pagedserve.scheduler.free_runs import FreeRuns
from pagedserve.scheduler.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from pagedserve.scheduler.request import Sequence

NULL_BLOCK = -1  # a released table entry below the sliding window


def _live(blocks: list[int]) -> list[int]:
    return [b for b in blocks if b != NULL_BLOCK]


def hash_block(parent: BlockHash | None, token_ids: tuple[int, ...], salt: str | None) -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else (salt or "").encode() + b"\x00root")
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return h.digest()


def prompt_block_hashes(token_ids: list[int], block_size: int, salt: str | None) -> list[BlockHash]:
    """The chained hashes of the blocks ``match_prefix`` looks up for this prompt (its full blocks, short of its last
    token): what a router compares with a replica's cached hashes."""
    hashes: list[BlockHash] = []
    parent = None
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block(parent, tuple(token_ids[i * block_size: (i + 1) * block_size]), salt)
        hashes.append(parent)
    return hashes


@dataclass(eq=False)
class CachedBlockInfo:
    block_hash: BlockHash
    parent: CachedBlockInfo | None  # the entry this block's KV was computed after
    token_ids: tuple[int, ...]


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False, spread: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.free_blocks = FreeRuns(num_blocks, spread)  # never cached, or evicted
        self.evictor: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced, oldest first
        self.cached: dict[BlockHash, int] = {}
        self.info: dict[int, CachedBlockInfo] = {}
        self.events: list[KVEvent] | None = None  # recorded only once someone drains them (see take_events)

    @property
    def num_free(self) -> int:
        return len(self.free_blocks) + len(self.evictor)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """``n`` blocks, continuing from block ``after`` while the blocks after it are free."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free} free")
        blocks: list[int] = []
        if after is not None:
            blocks = list(range(after + 1, after + 1 + self.free_blocks.take_after(after, n)))
        blocks += self.free_blocks.take(min(n - len(blocks), len(self.free_blocks)))
        while len(blocks) < n:
            b, _ = self.evictor.popitem(last=False)
            evicted = self.info.pop(b).block_hash
            del self.cached[evicted]
            if self.events is not None:
                self.events.append(BlockRemoved(evicted))
            blocks.append(b)
        for b in blocks:
            self.ref_cnt[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self.evictor[b]
            self.ref_cnt[b] += 1

    def decref(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                if b in self.info:
                    self.evictor[b] = None
                else:
                    self.free_blocks.put(b)
            elif self.ref_cnt[b] < 0:
                raise RuntimeError(f"KV block {b} freed twice")

    def lookup(self, block_hash: BlockHash, parent: CachedBlockInfo | None,
               token_ids: tuple[int, ...]) -> int | None:
        b = self.cached.get(block_hash)
        if b is None:
            return None
        info = self.info[b]
        return b if info.parent is parent and info.token_ids == token_ids else None

    def register(self, block: int, block_hash: BlockHash, parent: CachedBlockInfo | None,
                 token_ids: tuple[int, ...]) -> bool:
        # A block computed twice concurrently stays uncached: the first copy serves lookups.
        if block_hash in self.cached or block in self.info:
            return False
        self.cached[block_hash] = block
        self.info[block] = CachedBlockInfo(block_hash, parent, token_ids)
        if self.events is not None:
            self.events.append(BlockStored(block_hash, parent.block_hash if parent is not None else None))
        return True

    def take_events(self) -> list[KVEvent]:
        """The cache's events since the last call; the first call starts the recording."""
        events, self.events = self.events or [], []
        return events

    def reset_cache(self) -> None:
        if self.events is not None and self.cached:
            self.events.append(AllBlocksCleared())
        self.cached.clear()
        self.info.clear()
        for b in self.evictor:
            self.free_blocks.put(b)
        self.evictor.clear()


class BlockManager:
    """The device pool (with the prefix cache) and the CPU swap pool, and every sequence's block table in them.
    What the workers already hold of a table is the scheduler's business, not this class's."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False, num_cpu_blocks: int = 0,
                 share_blocks: bool = True, watermark: float = 0.01, sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        # share_blocks=False is the no-sharing baseline: a forked sequence copies every shared block.
        self.share_blocks = share_blocks
        self.pool = BlockPool(num_blocks, enable_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks, spread=False)  # swapped tables do not grow
        self._swapped: set[int] = set()  # sequences whose block table points into the CPU pool
        # New requests are admitted only while this many blocks stay free, so running ones can grow.
        self.watermark_blocks = int(watermark * num_blocks)
        self.num_copy_on_write = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / max(self.pool.num_blocks, 1)

    def num_shared_blocks(self) -> int:
        return sum(1 for c in self.pool.ref_cnt if c > 1)

    def _blocks_to_grow(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table))

    def group_blocks_needed(self, seqs: list[Sequence], num_new_tokens: int) -> int:
        """Blocks that the next ``num_new_tokens`` of each of ``seqs`` (one request's, allocated together) take:
        new blocks, plus a copy of each shared block about to be written, except that the last holder of a shared
        block keeps the original (per block, min(writers, holders - 1) copies)."""
        grow = 0
        writers: Counter[int] = Counter()
        for s in seqs:
            n = min(num_new_tokens, s.num_pending_tokens)
            grow += self._blocks_to_grow(s, n)
            writers.update(s.block_table[i] for i in self._cow_targets(s, n))
        return grow + sum(min(w, self.pool.ref_cnt[b] - 1) for b, w in writers.items())

    def can_admit(self, seqs: list[Sequence], num_new_tokens: int, use_watermark: bool = True) -> bool:
        need = self.group_blocks_needed(seqs, num_new_tokens)
        return self.pool.num_free - need >= (self.watermark_blocks if use_watermark else 0)

    def _cow_targets(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Logical blocks to copy before this step: the shared block the next write lands in
        (or, without sharing, every shared block)."""
        ref = self.pool.ref_cnt
        if not self.share_blocks:
            return [i for i, b in enumerate(seq.block_table) if b != NULL_BLOCK and ref[b] > 1]
        i = seq.num_computed_tokens // self.block_size
        return [i] if num_new_tokens > 0 and i < len(seq.block_table) and ref[seq.block_table[i]] > 1 else []

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       blocks_to_copy: list[tuple[int, int]] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens; False (and no change) if out of blocks.

        A shared block about to be written is replaced by a private copy, recorded in ``blocks_to_copy``.
        """
        self.release_below_window(seq)
        cow = self._cow_targets(seq, num_new_tokens)
        need = self._blocks_to_grow(seq, num_new_tokens)  # copies keep the table's length
        if need + len(cow) > self.pool.num_free:
            return False
        for i in cow:
            src = seq.block_table[i]
            (dst,) = self.pool.allocate(1, seq.block_table[i - 1] if i else None)
            self.pool.decref([src])
            seq.block_table[i] = dst
            if blocks_to_copy is None:
                raise RuntimeError("copy-on-write needed but no blocks_to_copy list was given")
            blocks_to_copy.append((src, dst))
            self.num_copy_on_write += 1
        if need:
            seq.block_table.extend(self.pool.allocate(need, seq.block_table[-1] if seq.block_table else None))
        return True

    def release_below_window(self, seq: Sequence) -> None:
        """Release the blocks wholly below the sliding window of the sequence's next query (at position
        ``num_computed_tokens``): keys at positions < num_computed_tokens - window + 1 are never read again."""
        if self.sliding_window is None or seq.seq_id in self._swapped:
            return
        below = min(max(0, seq.num_computed_tokens - self.sliding_window + 1) // self.block_size,
                    len(seq.block_table))
        table = seq.block_table
        if below == 0 or table[below - 1] == NULL_BLOCK:
            return
        start = below - 1  # released blocks form a leading run: only the ones since the last release are live
        while start and table[start - 1] != NULL_BLOCK:
            start -= 1
        self.pool.decref(table[start:below])  # a shared prefix's block is only dereferenced
        table[start:below] = [NULL_BLOCK] * (below - start)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        self.pool.incref(_live(child.block_table))

    def trim(self, seq: Sequence) -> None:
        """Release the tail blocks past the sequence's computed tokens (the KV of drafts it did not accept)."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        tail = seq.block_table[keep:]
        if tail:
            self.pool.decref(_live(tail[::-1]))
            del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, in whichever pool they are."""
        if seq.seq_id in self._swapped:
            self._swapped.discard(seq.seq_id)
            self.cpu_pool.decref(_live(seq.block_table))
        else:
            # Tail blocks first, so the evictor reclaims a prefix's tail before its head.
            self.pool.decref(_live(seq.block_table[::-1]))
        seq.block_table = []

    # ---- swap space --------------------------------------------------------------------------
    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]] | None:
        """Move a request's blocks to the CPU pool, keeping what its sequences share shared: the (device block,
        CPU block) pairs to copy, or None (and no change) if the CPU pool is too small."""
        distinct = sorted({b for s in seqs for b in _live(s.block_table)})
        if len(distinct) > self.cpu_pool.num_free:
            return None
        mapping = dict(zip(distinct, self.cpu_pool.allocate(len(distinct))))
        mapping[NULL_BLOCK] = NULL_BLOCK
        for seq in seqs:
            cpu_table = [mapping[b] for b in seq.block_table]
            self.free(seq)
            seq.block_table = cpu_table
            self._swapped.add(seq.seq_id)
        # Each CPU block starts with one reference; add the others (blocks shared inside the request).
        refs = [b for s in seqs for b in _live(s.block_table)]
        for b in set(refs):
            self.cpu_pool.incref([b] * (refs.count(b) - 1))
        del mapping[NULL_BLOCK]
        return list(mapping.items())

    def swap_in(self, seqs: list[Sequence], num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped request back if its blocks and each sequence's next ``num_new_tokens`` fit: the (CPU
        block, device block) pairs to copy, or None (and no change)."""
        refs = Counter(b for s in seqs for b in _live(s.block_table))
        # Shared CPU blocks come back shared; without sharing, every sequence gets its own copies.
        restore = sorted(refs) if self.share_blocks else list(refs.elements())
        bs = self.block_size
        grow, writers = 0, Counter()
        for s in seqs:
            n = min(num_new_tokens, s.num_pending_tokens)
            grow += max(0, -(-(s.num_computed_tokens + n) // bs) - len(s.block_table))
            i = s.num_computed_tokens // bs
            if n > 0 and i < len(s.block_table) and s.block_table[i] != NULL_BLOCK:
                writers[s.block_table[i]] += 1
        # A block that comes back shared is copied when written, except by its last holder.
        copies = sum(min(w, refs[c] - 1) for c, w in writers.items()) if self.share_blocks else 0
        if len(restore) + grow + copies > self.num_free_blocks:
            return None
        pairs: list[tuple[int, int]] = []
        if self.share_blocks:
            mapping = dict(zip(restore, self.pool.allocate(len(restore))))
            for c in restore:
                self.pool.incref([mapping[c]] * (refs[c] - 1))
            pairs = list(mapping.items())
            mapping[NULL_BLOCK] = NULL_BLOCK
        for seq in seqs:
            live = _live(seq.block_table)
            self.cpu_pool.decref(live)
            self._swapped.discard(seq.seq_id)
            if self.share_blocks:
                seq.block_table = [mapping[c] for c in seq.block_table]
            else:
                new = self.pool.allocate(len(live))
                pairs += zip(live, new)
                fresh = iter(new)
                seq.block_table = [b if b == NULL_BLOCK else next(fresh) for b in seq.block_table]
        return pairs

    # ---- prefix caching ----------------------------------------------------------------------
    def match_prefix(self, seq: Sequence, salt: str | None) -> list[int]:
        """Cached blocks holding a prefix of ``seq`` (never its last token, which must be recomputed)."""
        if not self.pool.enable_caching:
            return []
        bs = self.block_size
        hashes, blocks, parent_hash, parent = [], [], None, None
        for i in range((seq.num_tokens - 1) // bs):
            toks = tuple(seq.token_ids[i * bs: (i + 1) * bs])
            h = hash_block(parent_hash, toks, salt)
            b = self.pool.lookup(h, parent, toks)
            if b is None:
                break
            hashes.append(h)
            blocks.append(b)
            parent_hash, parent = h, self.pool.info[b]
        seq.block_hashes = hashes
        return blocks

    def take_prefix(self, seq: Sequence, blocks: list[int]) -> None:
        self.pool.incref(blocks)
        seq.block_table = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size

    def cache_full_blocks(self, seq: Sequence, salt: str | None) -> None:
        """Register the blocks that became full and computed, so later requests can reuse them."""
        if not self.pool.enable_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(len(seq.block_hashes), num_full):
            parent_hash = seq.block_hashes[-1] if seq.block_hashes else None
            # Chain only onto this sequence's own cached parent: its entry holds exactly our prefix.
            parent = self.pool.info.get(seq.block_table[i - 1]) if i else None
            if (i and (parent is None or parent.block_hash != parent_hash)) or seq.block_table[i] == NULL_BLOCK:
                return
            toks = tuple(seq.token_ids[i * bs: (i + 1) * bs])
            h = hash_block(parent_hash, toks, salt)
            seq.block_hashes.append(h)
            self.pool.register(seq.block_table[i], h, parent, toks)

    # ---- KV handoff between replicas ------------------------------------------------------------
    def cached_run(self, block_hashes: list[BlockHash]) -> list[int]:
        """The cached blocks of the leading run of these chained hashes (the first miss ends it)."""
        blocks = []
        for h in block_hashes:
            b = self.pool.cached.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def block_token_ids(self, blocks: list[int]) -> list[tuple[int, ...]]:
        return [self.pool.info[b].token_ids for b in blocks]

    def reserve(self, n: int) -> list[int]:
        """``n`` blocks to write another replica's KV into, if that leaves the admission watermark free; else none."""
        if not self.pool.enable_caching or n > self.pool.num_free - self.watermark_blocks:
            return []
        return self.pool.allocate(n)

    def insert_cached(self, blocks: list[int], block_hashes: list[BlockHash], token_ids: list[tuple[int, ...]],
                      parent_hash: BlockHash | None, num_written: int) -> int:
        """Register the first ``num_written`` reserved blocks (their KV written) in the prefix cache, chained to the
        cached ``parent_hash``, and let go of all of them: the registered ones wait in the cache like any computed
        block, the rest are free again. Returns how many new blocks the cache holds."""
        parent = None
        if parent_hash is not None:
            b = self.pool.cached.get(parent_hash)
            parent = self.pool.info[b] if b is not None else None
            if parent is None:
                num_written = 0  # evicted meanwhile: nothing can chain onto it
        inserted = 0
        for b, h, toks in zip(blocks[:num_written], block_hashes, token_ids):
            if h in self.pool.cached:  # computed here meanwhile: that copy serves
                parent = self.pool.info[self.pool.cached[h]]
                continue
            self.pool.register(b, h, parent, toks)
            parent = self.pool.info[b]
            inserted += 1
        self.pool.decref(blocks)
        return inserted

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()

    def take_kv_events(self) -> list[KVEvent]:
        """Blocks stored in and evicted from the prefix cache since the last call (recorded from the first call)."""
        return self.pool.take_events()

    def cached_block_hashes(self) -> list[BlockHash]:
        return list(self.pool.cached)
