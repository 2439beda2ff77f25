"""How many replicas the load asks for, from LLM signals (waiting requests per replica, KV-cache usage, TTFT p90),
and, with ``--autoscale``, acting on it through the ``ReplicaSet``. With disaggregated prefill and decode each pool
has its own autoscaler on its own signals: the prefill pool on the prompt tokens queued per replica and TTFT p90,
the decode pool on waiting requests and KV-cache usage.

Like Kubernetes' HPA: each signal's ratio to its target scales the current count, the largest ratio wins, a ratio
within ``TOLERANCE`` of 1 changes nothing, a scale-out waits ``scale_out_cooldown`` after the last change, and a
scale-in takes the highest count asked for over the last ``scale_in_cooldown`` seconds (so a short lull never
releases a replica the next burst needs). The decision and its inputs are exported as metrics whether or not it acts,
so an external autoscaler (KEDA, an HPA) can follow the same numbers.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, fields

from prometheus_client.core import GaugeMetricFamily, Metric

from pagedserve.cluster.runtime.replica_set import ReplicaSet
from pagedserve.cluster.runtime.replicas import Replica
from pagedserve.cluster.runtime.router import ReplicaRouter
from pagedserve.engine.core_types import EngineStats

logger = logging.getLogger(__name__)

TOLERANCE = 0.1


@dataclass(frozen=True)
class AutoscalePolicy:
    min: int = 1
    max: int = 4
    waiting: float = 4.0  # target waiting requests per replica
    kv_usage: float = 0.8  # target KV-cache usage (0..1), mean over replicas
    ttft_p90: float = 2.0  # target seconds to first token, p90 over the last interval
    prefill_tokens: float = 8192.0  # a prefill pool's target queued prompt tokens per replica
    interval: float = 5.0  # seconds between decisions
    scale_out_cooldown: float = 30.0
    scale_in_cooldown: float = 300.0

    @classmethod
    def parse(cls, spec: str) -> AutoscalePolicy:
        """``min=1,max=4,waiting=4,kv_usage=0.8,ttft_p90=2,interval=5,scale_out_cooldown=30,scale_in_cooldown=300``
        (any subset)."""
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, float | int] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in types:
                raise ValueError(f"--autoscale: {part!r} is not KEY=VALUE with KEY one of {', '.join(types)}")
            try:
                values[key] = int(value) if types[key] == "int" else float(value)
            except ValueError:
                raise ValueError(f"--autoscale: {key}={value!r} is not a number") from None
        policy = cls(**values)
        if not 1 <= policy.min <= policy.max:
            raise ValueError(f"--autoscale: need 1 <= min <= max, got min={policy.min}, max={policy.max}")
        if min(policy.waiting, policy.kv_usage, policy.ttft_p90, policy.prefill_tokens, policy.interval) <= 0:
            raise ValueError("--autoscale: targets and interval must be positive")
        return policy


@dataclass
class Signals:
    replicas: int  # serving now
    waiting_per_replica: float
    running: int
    kv_usage: float  # mean over replicas
    ttft_p90: float | None  # None: no request started in the interval
    waiting_tokens_per_replica: float = 0.0


def desired_replicas(policy: AutoscalePolicy, s: Signals, pool: str | None = None) -> int:
    """The count the signals ask for now, within [min, max] (before cooldowns and stabilization); ``pool``: "prefill"
    or "decode" with disaggregated prefill and decode (None: replicas that run whole requests)."""
    current = max(s.replicas, 1)
    if s.running == 0 and s.waiting_per_replica == 0:
        return policy.min  # idle
    if pool == "prefill":
        ratios = [s.waiting_tokens_per_replica / policy.prefill_tokens]
    else:
        ratios = [s.waiting_per_replica / policy.waiting, s.kv_usage / policy.kv_usage]
    if s.ttft_p90 is not None and pool != "decode":  # a decode pool's requests got their first token elsewhere
        ratios.append(s.ttft_p90 / policy.ttft_p90)
    ratio = max(ratios)
    want = current if abs(ratio - 1) <= TOLERANCE else math.ceil(current * ratio)
    return min(max(want, policy.min), policy.max)


def signals(stats: list[EngineStats], serving: int, ttfts: list[float]) -> Signals:
    n = max(len(stats), 1)
    ttft_p90 = sorted(ttfts)[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else None
    return Signals(serving, sum(s.num_waiting for s in stats) / max(serving, 1), sum(s.num_running for s in stats),
                   sum(s.kv_usage for s in stats) / n, ttft_p90,
                   sum(s.num_waiting_tokens for s in stats) / max(serving, 1))


class Autoscaler:
    """``act``: change the replica count (``--autoscale``); else only recommend (the metrics). ``pool``: the pool it
    scales ("prefill" or "decode"), None without disaggregation."""

    def __init__(self, policy: AutoscalePolicy, router: ReplicaRouter, replica_set: ReplicaSet, act: bool,
                 pool: str | None = None) -> None:
        self.policy = policy
        self.router = router
        self.replica_set = replica_set
        self.act = act
        self.pool = pool
        serving = sum(r.serving for r in self._members())
        self.last = Signals(serving, 0.0, 0, 0.0, None)
        self.desired = serving
        self._history: deque[tuple[float, int]] = deque()  # (time, desired) over the scale-in window
        self._last_change = time.monotonic()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.policy.interval)
            try:
                await self.tick()
            except Exception:  # a replica dying mid-read, a scale that failed: the next interval tries again
                logger.exception("autoscaler: this interval's decision failed")

    def _members(self) -> list[Replica]:
        picker = self.router.disagg.prefill_picker if self.pool == "prefill" else self.router.picker
        return picker.pool()

    async def tick(self) -> None:
        members = [r for r in self._members() if r.alive]
        stats = await asyncio.gather(*[r.actor.get_stats.remote() for r in members], return_exceptions=True)
        ttfts = self.router.take_ttfts() if self.pool != "decode" else []
        self.last = signals([s for s in stats if isinstance(s, EngineStats)], sum(r.serving for r in members), ttfts)
        now = time.monotonic()
        want = desired_replicas(self.policy, self.last, self.pool)
        self._history.append((now, want))
        while self._history and self._history[0][0] < now - self.policy.scale_in_cooldown:
            self._history.popleft()
        current = self.last.replicas
        if want > current:
            self.desired = want
        else:  # the highest asked for within the window: no scale-in on a lull
            self.desired = max(w for _, w in self._history)
        if not self.act or self.replica_set.is_scaling or self.desired == current:
            return
        since = now - self._last_change
        if (self.desired > current and since >= self.policy.scale_out_cooldown) or \
                (self.desired < current and since >= self.policy.scale_in_cooldown):
            logger.info("autoscaler: %d -> %d %sreplicas (%s)", current, self.desired,
                        f"{self.pool} " if self.pool else "", self.last)
            await self.replica_set.scale_to(self.desired, pool=self.pool)
            self._last_change = time.monotonic()



def collect_metrics(autoscalers: list[Autoscaler]) -> list[Metric]:
    """Every autoscaler's decision and inputs, labelled by pool when they scale pools."""
    pooled = any(a.pool is not None for a in autoscalers)
    labels = ["pool"] if pooled else []
    desired = GaugeMetricFamily("pagedserve_desired_replicas", "Replicas the autoscaling policy asks for (acted on "
                                "with --autoscale; else a recommendation for KEDA or an HPA).", labels=labels)
    sig = GaugeMetricFamily("pagedserve_autoscaler_signal", "The autoscaling policy's inputs, by signal.",
                            labels=["signal", *labels])
    for a in autoscalers:
        pool = [a.pool] if pooled else []
        desired.add_metric(pool, a.desired)
        sig.add_metric(["waiting_per_replica", *pool], a.last.waiting_per_replica)
        sig.add_metric(["kv_usage", *pool], a.last.kv_usage)
        if pooled:
            sig.add_metric(["waiting_tokens_per_replica", *pool], a.last.waiting_tokens_per_replica)
        if a.last.ttft_p90 is not None:
            sig.add_metric(["ttft_p90_seconds", *pool], a.last.ttft_p90)
    return [desired, sig]
