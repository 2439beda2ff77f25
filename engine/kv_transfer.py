"""What moves between replicas in a KV handoff (vLLM's KV-connector terms): the producer (``kv_producer``, the
prefill replica) exports the cached blocks of a chain of prefix hashes, every TP rank's share, with a checksum of
each block's bytes (:func:`seal`); the consumer (``kv_consumer``, the decode replica) keeps the leading blocks whose
bytes still match (:func:`verified`), writes them into free blocks of its own and registers them in its prefix
cache, where the request it then resumes finds them like any cached prefix. A block that does not arrive, or
arrives corrupted, is simply not cached there: the consumer computes it, so a failed transfer costs time, never a
token. Sealing and checking run off the engine thread (in the engine-core actor), so they never stall a step."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

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

    def head(self, n: int) -> KVHandoff:
        return KVHandoff(self.block_hashes[:n], self.token_ids[:n], [r.head(n) for r in self.ranks])


@dataclass(frozen=True)
class KVImport:
    """How a consumer's pull went: blocks of the chain it already held, blocks the producer sent, and those of them
    that went into its cache (the rest of the chain it computes)."""

    num_cached: int
    num_received: int = 0
    num_inserted: int = 0
    num_bytes: int = 0


def block_digests(data: KVBlockData) -> list[bytes]:
    """Per block: CRC-32 of its K bytes and of its V bytes over every layer (a check against corruption in transit
    and in memory, at several GB/s; what identifies the content is the block's chained token hash)."""
    def crc(t: torch.Tensor) -> bytes:
        return zlib.crc32(memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")).to_bytes(4, "little")

    return [crc(data.k[:, i]) + crc(data.v[:, i]) for i in range(data.num_blocks)]


def seal(handoff: KVHandoff) -> KVHandoff:
    """The producer side: each rank's block checksums, as read."""
    for r in handoff.ranks:
        r.digests = block_digests(r)
    return handoff


def verified(handoff: KVHandoff) -> KVHandoff:
    """The consumer side: the leading blocks whose bytes match their checksums on every rank."""
    good = handoff.num_blocks
    for r in handoff.ranks:
        ok = 0
        for want, got in zip(r.digests or (), block_digests(r)):
            if want != got:
                break
            ok += 1
        good = min(good, ok)
    return handoff if good == handoff.num_blocks else handoff.head(good)
