"""The prefill side of a KV handoff: the prompt blocks of each request that ended for a decode replica
(``do_remote_decode``), held in the prefix cache under a lease until the decode side acknowledges its pull or the
lease runs out, whichever comes first. Held blocks are referenced, so nothing evicts them meanwhile."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.scheduler.block_manager import BlockManager


@dataclass
class KVLease:
    blocks: list[int]
    deadline: float


class KVLeases:
    """``lease_s``: how long a request's blocks are held at most (``SchedulerConfig.kv_lease_s``)."""

    def __init__(self, block_manager: BlockManager, lease_s: float) -> None:
        self.block_manager = block_manager
        self.lease_s = lease_s
        self.leases: dict[str, KVLease] = {}
        self.num_expired = 0

    def hold(self, request_id: str, blocks: list[int], now: float) -> None:
        self.release(request_id)
        self.block_manager.pool.incref(blocks)
        self.leases[request_id] = KVLease(list(blocks), now + self.lease_s)

    def release(self, request_id: str) -> bool:
        lease = self.leases.pop(request_id, None)
        if lease is None:
            return False
        self.block_manager.pool.decref(lease.blocks)
        return True

    def expire(self, now: float) -> list[str]:
        """End the leases past their deadline; returns their request ids."""
        gone = [rid for rid, lease in self.leases.items() if lease.deadline <= now]
        for rid in gone:
            self.release(rid)
        self.num_expired += len(gone)
        return gone

    def release_all(self) -> None:
        """The KV is gone (the workers were rebuilt): nothing is held any more."""
        for rid in list(self.leases):
            self.release(rid)

    @property
    def num_blocks(self) -> int:
        return sum(len(lease.blocks) for lease in self.leases.values())
