"""The order of requests: which waiting request is admitted next and which running one is preempted first.

``fcfs``: by arrival. ``priority`` (vLLM's ``--scheduling-policy priority``): by (priority, arrival), a lower value
first; the running request with the worst key is preempted first, and a waiting request may preempt running ones
of a worse priority to start. With token fairness (``--fairness tokens``), among waiting requests of the same
priority the tenant with the least weighted service so far goes first: a virtual token counter per tenant (VTC,
Sheng et al., OSDI 2024) that counts every token scheduled for it (prompt, recompute and decode) over its weight.
"""
from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator
from itertools import groupby

from pagedserve.scheduler.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")
FAIRNESS_MODES = ("none", "tokens")


def fcfs_key(req: Request) -> tuple[int, int]:
    return 0, req.arrival_index


def priority_key(req: Request) -> tuple[int, int]:
    return req.priority, req.arrival_index


def order_key(policy: str) -> Callable[[Request], tuple[int, int]]:
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
    return priority_key if policy == "priority" else fcfs_key


class TokenFairness:
    """Each tenant's weighted service in tokens. A tenant that arrives with nothing queued or running starts at the
    least service among the tenants being served (or, with none, at the most any tenant had), so idling earns no
    credit; the counters of idle tenants that would be lifted anyway are forgotten, which bounds them."""

    def __init__(self) -> None:
        self._service: dict[str, float] = {}
        self._load: dict[str, int] = {}  # tenant -> its unfinished requests
        self._floor = 0.0  # never decreases: where a forgotten or new tenant starts

    def service(self, tenant: str) -> float:
        return self._service.get(tenant, self._floor)

    def charge(self, req: Request, num_tokens: int) -> None:
        t = req.tenant.name
        self._service[t] = self.service(t) + num_tokens / req.tenant.weight

    def arrive(self, req: Request) -> None:
        t = req.tenant.name
        if self._load.get(t, 0) == 0:
            active = [self.service(u) for u in self._load]
            self._floor = max(self._floor, min(active) if active else max(self._service.values(), default=0.0))
            self._service[t] = max(self.service(t), self._floor)
        self._load[t] = self._load.get(t, 0) + 1

    def leave(self, req: Request) -> None:
        t = req.tenant.name
        self._load[t] -= 1
        if self._load[t] == 0:
            del self._load[t]
            if self._service.get(t, self._floor) <= self._floor:
                self._service.pop(t, None)

    @property
    def num_tracked(self) -> int:
        return len(self._service)


class WaitingQueue:
    """Waiting requests sorted by the policy's key; ``admission_order`` is the order to try them in."""

    def __init__(self, key: Callable[[Request], tuple[int, int]], fairness: TokenFairness | None = None) -> None:
        self.key = key
        self.fairness = fairness
        self._reqs: list[Request] = []

    def add(self, req: Request) -> None:
        bisect.insort(self._reqs, req, key=self.key)

    def remove(self, req: Request) -> None:
        self._reqs.remove(req)

    def replace_all(self, reqs: list[Request]) -> None:
        self._reqs = sorted(reqs, key=self.key)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs)

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, req: object) -> bool:
        return req in self._reqs

    def admission_order(self) -> Iterator[Request]:
        """The waiting requests in the order to admit them, over a snapshot (admitting removes from the queue).
        With fairness each one is chosen when the previous has been scheduled, so its tokens already count."""
        snapshot = list(self._reqs)
        if self.fairness is None:
            yield from snapshot
            return
        for _, level in groupby(snapshot, key=lambda r: self.key(r)[0]):
            by_tenant: dict[str, deque[Request]] = {}
            for req in level:
                by_tenant.setdefault(req.tenant.name, deque()).append(req)
            while by_tenant:
                tenant = min(by_tenant, key=self.fairness.service)  # ties: the tenant with the earliest head
                queue = by_tenant[tenant]
                yield queue.popleft()
                if not queue:
                    del by_tenant[tenant]
