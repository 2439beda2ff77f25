"""Which replica a request goes to: the routing policies (``--routing-policy``) over the replicas that serve now.

A policy sees each live replica's load as this gateway knows it (``Candidate``): its requests in flight, its work in
tokens (the prompt tokens its requests still have to prefill plus the output tokens they may still generate, capped
per request at ``DECODE_ESTIMATE_CAP``), and the block hashes in its prefix cache (from its KV events).

``prefix-aware`` scores a replica by ``uncached prompt tokens + balance_factor * work`` and takes the lowest: the
prefill it saves is weighed against the queue it joins, so a hot prefix stays on the replica that holds it until
that replica has ``uncached_elsewhere / balance_factor`` more tokens of work than another, and then spreads (the
second replica caches it too). ``balance_factor`` 0 routes by cache alone; large values approach least-loaded.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

DECODE_ESTIMATE_CAP = 256  # output tokens a request is expected to add to its replica's work, at most
DEFAULT_BALANCE_FACTOR = 1.0

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
