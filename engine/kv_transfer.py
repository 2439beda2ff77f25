"""What moves between replicas in a KV handoff (vLLM's KV-connector terms): the producer (``kv_producer``, the
prefill replica) exports the cached blocks of a chain of prefix hashes, every TP rank's share; the consumer
(``kv_consumer``, the decode replica) writes those whose bytes match their digests into free blocks of its own and
registers them in its prefix cache, where the request it then resumes finds them like any cached prefix. A block
that does not arrive, or arrives corrupted, is simply not cached there: the consumer computes it, so a failed
transfer costs time, never a token."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler.kv_events import BlockHash
from pagedserve.worker.kv_transfer import KVBlockData


@dataclass
class KVHandoff:
    """The leading blocks of a hash chain the producer held: ``ranks[i]`` is TP rank i's KV of them."""

    block_hashes: list[BlockHash]
    token_ids: list[tuple[int, ...]]
    ranks: list[KVBlockData] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranks)


@dataclass(frozen=True)
class KVImport:
    """How a consumer's pull went: blocks of the chain it already held, blocks the producer sent, and those of them
    that went into its cache (the rest of the chain it computes)."""

    num_cached: int
    num_received: int = 0
    num_inserted: int = 0
    num_bytes: int = 0
