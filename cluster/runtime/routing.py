"""Which replica a request goes to: the routing policies (``--routing-policy``) over the replicas that serve now.

A policy sees each live replica's load as this gateway knows it (``Candidate``): its requests in flight, its work in
tokens (the prompt tokens its requests still have to prefill plus the output tokens they may still generate, capped
per request at ``DECODE_ESTIMATE_CAP``), and the block hashes in its prefix cache (from its KV events).

``prefix-aware`` scores a replica by ``uncached prompt tokens + balance_factor * work`` and takes the lowest: the
prefill it saves is weighed against the queue it joins, so a hot prefix stays on the replica that holds it until
that replica has ``uncached_elsewhere / balance_factor`` more tokens of work than another, and then spreads (the
second replica caches it too). ``balance_factor`` 0 routes by cache alone; large values approach least-loaded.

``ReplicaPicker`` applies the policy to a gateway's replicas, keeps each session on its last replica while that
serves and is not overloaded (see ``AFFINITY_OVERLOAD_RATIO``), and counts every decision by its reason.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from pagedserve.cluster.runtime.replicas import Replica, ReplicaRole, health_detail
from pagedserve.common.errors import EngineUnavailableError
from pagedserve.engine.core_types import EngineCoreRequest
from pagedserve.scheduler.block_manager import prompt_block_hashes

DECODE_ESTIMATE_CAP = 256  # output tokens a request is expected to add to its replica's work, at most
DEFAULT_BALANCE_FACTOR = 1.0
# A session's replica is overloaded (the session moves) when it runs more than this many times the requests of the
# least-loaded serving replica, plus the slack.
AFFINITY_OVERLOAD_RATIO = 2
AFFINITY_OVERLOAD_SLACK = 4
MAX_SESSIONS = 100_000  # sessions remembered, least recently used dropped first

POLICIES = ("least-loaded", "round-robin", "prefix-aware")
# Why a request went where it did (the ``reason`` label of pagedserve_routing_decisions_total).
REASONS = {
    "least-loaded": ("least_loaded",),
    "round-robin": ("round_robin",),
    "prefix-aware": ("prefix_hit", "balance", "no_match"),
}
AFFINITY_REASONS = ("affinity", "affinity_fallback")


class Candidate(Protocol):
    @property
    def index(self) -> int: ...
    @property
    def load(self) -> int: ...
    @property
    def work(self) -> int: ...
    @property
    def cached(self) -> set[bytes]: ...


C = TypeVar("C", bound=Candidate)


@dataclass
class RouteRequest:
    num_prompt_tokens: int
    block_hashes: list[bytes]  # the prompt's full blocks, chained as the engine hashes them (prefix-aware only)
    block_size: int


@dataclass
class Pick(Generic[C]):
    replica: C
    reason: str
    num_cached_tokens: int = 0  # prompt tokens expected to be cached there


def matched_blocks(cached: set[bytes], block_hashes: list[bytes]) -> int:
    """Leading blocks of the prompt cached on a replica (a chain: the first miss ends the match)."""
    n = 0
    for h in block_hashes:
        if h not in cached:
            break
        n += 1
    return n


class RoutingPolicy(ABC):
    name: str
    needs_block_hashes = False

    @abstractmethod
    def pick(self, live: Sequence[C], request: RouteRequest | None) -> Pick[C]:
        """``live`` is not empty; ``request`` is None for a resumed request (any replica that serves will do)."""


class LeastLoaded(RoutingPolicy):
    name = "least-loaded"

    def pick(self, live: Sequence[C], request: RouteRequest | None) -> Pick[C]:
        return Pick(min(live, key=lambda r: r.load), "least_loaded")


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, live: Sequence[C], request: RouteRequest | None) -> Pick[C]:
        r = live[self._next % len(live)]
        self._next += 1
        return Pick(r, "round_robin")


class PrefixAware(RoutingPolicy):
    name = "prefix-aware"
    needs_block_hashes = True

    def __init__(self, balance_factor: float = DEFAULT_BALANCE_FACTOR) -> None:
        if balance_factor < 0:
            raise ValueError(f"the routing balance factor must be >= 0, got {balance_factor}")
        self.balance_factor = balance_factor

    def pick(self, live: Sequence[C], request: RouteRequest | None) -> Pick[C]:
        if request is None:
            return Pick(min(live, key=lambda r: r.load), "balance")
        matched = {r.index: matched_blocks(r.cached, request.block_hashes) for r in live}

        def score(r: C) -> tuple[float, int]:
            uncached = request.num_prompt_tokens - matched[r.index] * request.block_size
            return uncached + self.balance_factor * r.work, r.load

        best = min(live, key=score)
        most = max(matched.values())
        reason = "no_match" if most == 0 else "prefix_hit" if matched[best.index] == most else "balance"
        return Pick(best, reason, matched[best.index] * request.block_size)


def make_policy(name: str, balance_factor: float = DEFAULT_BALANCE_FACTOR) -> RoutingPolicy:
    if name == "least-loaded":
        return LeastLoaded()
    if name == "round-robin":
        return RoundRobin()
    if name == "prefix-aware":
        return PrefixAware(balance_factor)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")


def default_policy(data_parallel_size: int) -> str:
    return "prefix-aware" if data_parallel_size > 1 else "least-loaded"


WHOLE_REQUESTS = frozenset({ReplicaRole.BOTH, ReplicaRole.DECODE})


class ReplicaPicker:
    """The replica for each request, from the replicas' state as it is now: one that is restarting or rebuilding is
    skipped, never waited on. ``replicas``: the router's list (it changes as replicas come and go), of which this
    picker considers those of ``roles`` (a pool: the decode pool also runs whole requests, and every resume)."""

    def __init__(self, replicas: list[Replica], policy: RoutingPolicy, block_size: int,
                 roles: frozenset[ReplicaRole] = WHOLE_REQUESTS) -> None:
        self.replicas = replicas
        self.roles = roles
        self.policy = policy
        self.block_size = block_size
        self._sessions: OrderedDict[str, int] = OrderedDict()  # session id -> replica index it last used
        # Every (policy, reason) at zero from the start; only values change after (read on the scrape thread).
        self.decisions = {reason: 0 for reason in REASONS[policy.name] + AFFINITY_REASONS}

    def replica(self, index: int) -> Replica | None:
        return next((r for r in self.replicas if r.index == index), None)

    def pool(self) -> list[Replica]:
        return [r for r in self.replicas if r.role in self.roles]

    def live(self) -> list[Replica]:
        live = [r for r in self.pool() if r.serving]
        if not live:
            raise EngineUnavailableError(f"no model replica is available ({health_detail(self.pool())})")
        return live

    def route(self, request: EngineCoreRequest, session_id: str | None = None) -> Pick[Replica]:
        """A new request's replica: the session's while it serves and is not overloaded, else the policy's."""
        live = self.live()
        ids = request.prompt_token_ids
        route = RouteRequest(len(ids), prompt_block_hashes(ids, self.block_size, request.cache_salt)
                             if self.policy.needs_block_hashes else [], self.block_size)
        pick = None
        if session_id is not None and (last := self._sessions.get(session_id)) is not None:
            r = self.replica(last)
            least = min(x.load for x in live)
            if r is not None and r.serving and r.load <= AFFINITY_OVERLOAD_RATIO * least + AFFINITY_OVERLOAD_SLACK:
                pick = Pick(r, "affinity")
            else:
                pick = dataclasses.replace(self.policy.pick(live, route), reason="affinity_fallback")
        if pick is None:
            pick = self.policy.pick(live, route)
        # Counted as cached there before the replica's events say so: a burst of one tenant's first requests then
        # follows the first instead of spreading over replicas that will each prefill the prefix again.
        pick.replica.cached.update(route.block_hashes)
        self.stick(session_id, pick.replica.index)
        self.decisions[pick.reason] += 1
        return pick

    def stick(self, session_id: str | None, index: int) -> None:
        """The session's requests go to replica ``index`` from now on."""
        if session_id is None:
            return
        self._sessions[session_id] = index
        self._sessions.move_to_end(session_id)
        if len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    def pick(self, avoid: dict[int, int] | None = None) -> Replica:
        """Any replica that serves now, for a request resumed from a dead one (its prompt and progress moved).
        ``avoid``: replica index -> its ``restarts`` when it failed this request (taken again once it came back)."""
        live = [r for r in self.live() if avoid is None or avoid.get(r.index) != r.restarts]
        if not live:
            raise EngineUnavailableError("every serving replica failed taking this request")
        return self.policy.pick(live, None).replica

    def least_loaded(self, tried: dict[int, int]) -> Replica | None:
        """The least-loaded replica that serves now and is not in ``tried`` (None if none is left)."""
        others = [r for r in self.pool() if r.serving and r.index not in tried]
        return min(others, key=lambda r: r.load) if others else None
