"""What a replica's prefix cache gained and lost, as plain data: the block manager records these, the engine core
hands them out once per step, and the engine-core actor streams them to every gateway, whose router keeps, per
replica, the set of block hashes cached there (``KVCacheSnapshot`` resyncs a router that connects late)."""
from __future__ import annotations

from dataclasses import dataclass

BlockHash = bytes


@dataclass(frozen=True)
class BlockStored:
    """A full block's KV became reusable under ``block_hash`` (chained to ``parent_hash``; None: the first block)."""

    block_hash: BlockHash
    parent_hash: BlockHash | None


@dataclass(frozen=True)
class BlockRemoved:
    """A cached block was evicted for reuse: its hash no longer matches."""

    block_hash: BlockHash


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventBatch:
    """One engine step's events, in order."""

    events: list[KVEvent]


@dataclass
class KVCacheSnapshot:
    """Every block hash cached now; replaces what a router knew of the replica."""

    block_hashes: list[BlockHash]
