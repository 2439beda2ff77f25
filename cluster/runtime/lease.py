"""A gateway's lease on each replica it routes to. The gateway's router renews it every ``GATEWAY_LEASE_S / 5``
seconds (see ``replica_health``); a replica that has not heard from a gateway for ``GATEWAY_LEASE_S`` takes it for
dead (a SIGKILLed process ends no Ray generator): its stream ends and its requests are aborted, so their KV blocks
are freed. A gateway that was only stalled sees its stream end and resumes them token-exact."""
from __future__ import annotations

import time
from collections.abc import Container

GATEWAY_LEASE_S = 10.0


class Leases:
    """An engine-core actor's side: when each gateway last renewed, and whose streams are ending (its lease ran out,
    or the replica moves its requests out)."""

    def __init__(self, lease_s: float = GATEWAY_LEASE_S) -> None:
        self.lease_s = lease_s
        self._heard: dict[str, float] = {}  # gateway id -> monotonic time of its last renewal
        self.ending: set[str] = set()

    @property
    def check_every_s(self) -> float:
        return min(1.0, self.lease_s / 4)

    def renew(self, client_id: str) -> None:
        self._heard[client_id] = time.monotonic()

    def forget(self, client_id: str) -> None:
        self.ending.discard(client_id)
        self._heard.pop(client_id, None)

    def overdue(self, streaming: Container[str]) -> list[tuple[str, float]]:
        """The gateways streaming here, not ending yet, silent past the lease: (id, seconds since last heard)."""
        now = time.monotonic()
        return [(client, now - heard) for client, heard in self._heard.items()
                if now - heard > self.lease_s and client not in self.ending and client in streaming]
