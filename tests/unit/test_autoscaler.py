"""The autoscaling policy: parsing ``--autoscale`` and the count each signal asks for (HPA's rule: the largest
ratio to target scales the current count, within a tolerance, clamped to [min, max])."""
from __future__ import annotations

import pytest

from pagedserve.cluster.runtime.autoscaler import AutoscalePolicy, Signals, desired_replicas, signals
from pagedserve.engine.core_types import EngineStats
from pagedserve.scheduler.stats import SchedulerStats


def test_parse_policy():
    p = AutoscalePolicy.parse("min=1, max=6,waiting=2,ttft_p90=0.5,scale_in_cooldown=10")
    assert (p.min, p.max, p.waiting, p.ttft_p90, p.scale_in_cooldown, p.kv_usage) == (1, 6, 2.0, 0.5, 10.0, 0.8)
    assert isinstance(p.max, int)
    for bad, why in [("min=3,max=2", "min <= max"), ("min=0", "min <= max"), ("size=3", "KEY=VALUE"),
                     ("max", "KEY=VALUE"), ("max=two", "not a number"), ("waiting=0", "positive")]:
        with pytest.raises(ValueError, match=why):
            AutoscalePolicy.parse(bad)


def test_desired_replicas_follows_the_largest_ratio():
    p = AutoscalePolicy(min=1, max=8, waiting=4, kv_usage=0.8, ttft_p90=2.0)
    assert desired_replicas(p, Signals(3, 0.0, 0, 0.0, None)) == 1  # idle: the minimum
    assert desired_replicas(p, Signals(2, 8.0, 10, 0.1, None)) == 4  # twice the waiting target
    assert desired_replicas(p, Signals(2, 4.2, 10, 0.1, None)) == 2  # within the tolerance: no change
    assert desired_replicas(p, Signals(2, 0.0, 10, 0.1, 5.0)) == 5  # TTFT p90 2.5x its target
    assert desired_replicas(p, Signals(4, 0.0, 10, 0.2, 0.5)) == 1  # every signal far below target
    assert desired_replicas(p, Signals(4, 100.0, 10, 0.2, None)) == 8  # clamped to max


def test_signals_from_replica_stats():
    def stats(waiting: int, running: int, usage: float) -> EngineStats:
        return EngineStats(num_running=running, num_waiting=waiting, num_swapped=0, kv_blocks_total=100,
                           kv_blocks_free=100, kv_blocks_shared=0, kv_usage=usage, copy_on_write=0, num_requests=0,
                           num_worker_restarts=0, num_constrained_requests=0, scheduler=SchedulerStats())

    s = signals([stats(6, 4, 0.5), stats(2, 4, 0.3)], 2, [0.1 * i for i in range(1, 11)])
    assert (s.waiting_per_replica, s.running, s.kv_usage) == (4.0, 8, pytest.approx(0.4))
    assert s.ttft_p90 == pytest.approx(1.0)
    assert signals([], 1, []).ttft_p90 is None


def test_each_pool_follows_its_own_signals():
    """Disaggregated: the prefill pool on queued prompt tokens and TTFT, the decode pool on waiting requests and KV
    usage, never on TTFT (its requests got their first token on the prefill pool)."""
    p = AutoscalePolicy(min=1, max=8, waiting=4, kv_usage=0.8, ttft_p90=2.0, prefill_tokens=1000)
    queued = Signals(2, 1.0, 4, 0.1, None, waiting_tokens_per_replica=3000)
    assert desired_replicas(p, queued, "prefill") == 6  # 3x the token target
    assert desired_replicas(p, queued, "decode") == 1  # few waiting, little KV: fewer decode replicas
    slow_first_token = Signals(2, 4.0, 4, 0.8, 6.0, waiting_tokens_per_replica=100)
    assert desired_replicas(p, slow_first_token, "prefill") == 6  # TTFT p90 3x its target
    assert desired_replicas(p, slow_first_token, "decode") == 2  # at its targets
    assert desired_replicas(p, Signals(2, 2.0, 4, 1.6, 0.1), "decode") == 4  # KV usage twice its target
    with pytest.raises(ValueError, match="positive"):
        AutoscalePolicy.parse("prefill_tokens=0")
