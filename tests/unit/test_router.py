"""The router's replica choice and health, on hand-built replica states (no Ray cluster, no model)."""
from __future__ import annotations

import asyncio

import pytest

from pagedserve.cluster.runtime import router as router_mod
from pagedserve.cluster.runtime.replicas import Replica
from pagedserve.cluster.runtime.router import ReplicaRouter
from pagedserve.config import RequestLimits
from pagedserve.engine.core_types import EngineInfo
from pagedserve.errors import EngineUnavailableError
from pagedserve.outputs import EngineHealth


def _info(num_kv_blocks: int) -> EngineInfo:
    return EngineInfo(model="m", architecture="LlamaForCausalLM", dtype="float32", max_model_len=64, vocab_size=100,
                      eos_token_ids=(2,), tensor_parallel_size=1, block_size=16, num_kv_blocks=num_kv_blocks,
                      enable_prefix_caching=True, limits=RequestLimits(max_seqs=4, max_logprobs=5,
                                                                       max_prompt_bytes=1000))


def _router(n: int = 3) -> ReplicaRouter:
    return ReplicaRouter([Replica(i, None, None) for i in range(n)], None, [_info(100 + i) for i in range(n)])


def test_requests_are_validated_against_the_smallest_kv_pool():
    assert _router(3).info.num_kv_blocks == 100


def test_pick_takes_the_least_loaded_serving_replica():
    router = _router()
    for state, load in zip(router.replicas, (3, 1, 2)):
        state.load = load
    assert router._pick().index == 1
    router.replicas[1].ready = False  # rebuilding its workers
    assert router._pick().index == 2
    router.replicas[2].alive = False
    assert router._pick().index == 0


def test_no_serving_replica_is_unavailable_and_unhealthy():
    router = _router(2)
    assert router.healthy
    for state in router.replicas:
        state.alive = False
    assert not router.healthy
    with pytest.raises(EngineUnavailableError):
        router._pick()


def test_a_waiting_request_takes_the_replica_that_comes_back():
    async def run() -> int:
        router = _router(2)
        for state in router.replicas:
            state.alive = False
        calls: list[bool] = []

        async def listener() -> None:
            calls.append(router.healthy)

        router.add_health_listener(listener)
        waiter = asyncio.create_task(router._wait_for_replica())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await router._set_state(router.replicas[1], alive=True)
        picked = await asyncio.wait_for(waiter, 1.0)
        assert calls == [True]
        return picked.index

    assert asyncio.run(run()) == 1


def test_a_waiting_request_gives_up_when_every_replica_is_gone(monkeypatch):
    monkeypatch.setattr(router_mod, "RESUME_WAIT_S", 30.0)

    async def run():
        router = _router(2)
        for state in router.replicas:
            state.alive = False
        waiter = asyncio.create_task(router._wait_for_replica())
        await asyncio.sleep(0.01)
        router.replicas[0].gone = True
        router.replicas[1].gone = True
        await router._set_state(router.replicas[1], alive=False)
        return await asyncio.wait_for(waiter, 1.0)

    assert asyncio.run(run()) is None


def test_a_failed_replica_is_routed_around_then_reported_with_its_error():
    async def run() -> None:
        router = _router(2)
        error = "RuntimeError: 0 active drivers"
        await router._deliver(router.replicas[0], [EngineHealth(healthy=False, reason=error, failed=True)])
        assert router.healthy and router._pick().index == 1 and router.health_detail == ""
        await router._deliver(router.replicas[1], [EngineHealth(healthy=False, reason=error, failed=True)])
        assert not router.healthy
        assert router.health_detail == f"replica 0 failed: {error}; replica 1 failed: {error}"
        with pytest.raises(EngineUnavailableError, match="0 active drivers"):
            router._pick()

    asyncio.run(run())


def test_a_rebuilding_replica_is_skipped_until_it_serves_again():
    async def run() -> None:
        router = _router(2)
        router.replicas[1].load = 5
        await router._deliver(router.replicas[0], [EngineHealth(healthy=False, reason="workers died")])
        assert router._pick().index == 1 and router.replicas[0].error is None
        await router._deliver(router.replicas[0], [EngineHealth(healthy=True)])
        assert router._pick().index == 0

    asyncio.run(run())
