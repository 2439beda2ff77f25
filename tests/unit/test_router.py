"""The router's replica choice and health, on hand-built replica states (no Ray cluster, no model)."""
from __future__ import annotations

import asyncio

import pytest
import ray

from pagedserve.cluster.runtime import resumption
from pagedserve.cluster.runtime.replicas import Replica
from pagedserve.cluster.runtime.router import ReplicaRouter
from pagedserve.common.config import RequestLimits
from pagedserve.common.errors import EngineUnavailableError, ReplicaDrainingError
from pagedserve.common.outputs import EngineCoreOutput, EngineHealth
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.engine.core_types import EngineCoreRequest, EngineInfo


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
    assert router.picker.pick().index == 1
    router.replicas[1].ready = False  # rebuilding its workers
    assert router.picker.pick().index == 2
    router.replicas[2].alive = False
    assert router.picker.pick().index == 0


def test_no_serving_replica_is_unavailable_and_unhealthy():
    router = _router(2)
    assert router.healthy
    for state in router.replicas:
        state.alive = False
    assert not router.healthy
    with pytest.raises(EngineUnavailableError):
        router.picker.pick()


def test_a_waiting_request_takes_the_replica_that_comes_back():
    async def run() -> int:
        router = _router(2)
        for state in router.replicas:
            state.alive = False
        calls: list[bool] = []

        async def listener() -> None:
            calls.append(router.healthy)

        router.add_health_listener(listener)
        waiter = asyncio.create_task(router.resumption.wait_for_replica())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await router.health.set_state(router.replicas[1], alive=True)
        picked = await asyncio.wait_for(waiter, 1.0)
        assert calls == [True]
        return picked.index

    assert asyncio.run(run()) == 1


def test_a_waiting_request_gives_up_when_every_replica_is_gone(monkeypatch):
    monkeypatch.setattr(resumption, "RESUME_WAIT_S", 30.0)

    async def run():
        router = _router(2)
        for state in router.replicas:
            state.alive = False
        waiter = asyncio.create_task(router.resumption.wait_for_replica())
        await asyncio.sleep(0.01)
        router.replicas[0].gone = True
        router.replicas[1].gone = True
        await router.health.set_state(router.replicas[1], alive=False)
        return await asyncio.wait_for(waiter, 1.0)

    assert asyncio.run(run()) is None


def test_a_failed_replica_is_routed_around_then_reported_with_its_error():
    async def run() -> None:
        router = _router(2)
        error = "RuntimeError: 0 active drivers"
        await router.health.deliver(router.replicas[0], [EngineHealth(healthy=False, reason=error, failed=True)])
        assert router.healthy and router.picker.pick().index == 1 and router.health_detail == ""
        await router.health.deliver(router.replicas[1], [EngineHealth(healthy=False, reason=error, failed=True)])
        assert not router.healthy
        assert router.health_detail == f"replica 0 failed: {error}; replica 1 failed: {error}"
        with pytest.raises(EngineUnavailableError, match="0 active drivers"):
            router.picker.pick()

    asyncio.run(run())


def test_a_rebuilding_replica_is_skipped_until_it_serves_again():
    async def run() -> None:
        router = _router(2)
        router.replicas[1].load = 5
        await router.health.deliver(router.replicas[0], [EngineHealth(healthy=False, reason="workers died")])
        assert router.picker.pick().index == 1 and router.replicas[0].error is None
        await router.health.deliver(router.replicas[0], [EngineHealth(healthy=True)])
        assert router.picker.pick().index == 0

    asyncio.run(run())


class _Method:
    def __init__(self, fn) -> None:
        self.remote = fn


class _Actor:
    """The engine-core actor calls a request makes, each add_request answered when the test says."""

    def __init__(self) -> None:
        self.adds: list[asyncio.Future] = []
        self.requests: list[EngineCoreRequest] = []
        self.aborted: list[str] = []
        self.add_request, self.abort = _Method(self._add), _Method(self._abort)

    def _add(self, client_id: str, request: EngineCoreRequest) -> asyncio.Future:
        self.requests.append(request)
        self.adds.append(asyncio.get_running_loop().create_future())
        return self.adds[-1]

    def _abort(self, request_ids: list[str]) -> asyncio.Future:
        self.aborted += request_ids
        done = asyncio.get_running_loop().create_future()
        done.set_result(request_ids)
        return done


async def _until(cond) -> None:
    for _ in range(200):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("never happened")


async def _request_sent_to_replica_0() -> tuple[list[_Actor], ReplicaRouter, asyncio.Future]:
    """Two replicas and request "a" routed to replica 0, whose add_request is under way; the stream's first output,
    awaited in the background."""
    actors = [_Actor(), _Actor()]
    router = ReplicaRouter([Replica(i, a, None) for i, a in enumerate(actors)], None, [_info(100)] * 2)
    router.replicas[1].load = 5  # the request goes to replica 0
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    stream = router.generate(None, EngineCoreRequest("a", [5, 6, 7], params), stream=True)
    first = asyncio.ensure_future(stream.__anext__())
    await _until(lambda: actors[0].adds)
    return actors, router, first


async def _finishes_on_replica_1(router: ReplicaRouter, first: asyncio.Future) -> None:
    await router.health.deliver(router.replicas[1], [EngineCoreOutput("a", {0: [9, 10]}, finish_reasons={
        0: ("length", None)}, finished=True)])
    out = await asyncio.wait_for(first, 1.0)
    assert out.finished and out.outputs[0].token_ids == [9, 10]


@pytest.mark.parametrize("answer", ["taken", "died"])
def test_a_request_its_replica_lets_go_while_taking_it_moves_on(answer):
    """A scale-in ends the gateway's stream (or the actor dies) while the request's add_request is still under way.
    The request is neither failed nor run twice: taken, it resumes on the other replica with its seed and is aborted
    on the first; refused by a dying actor, ``generate`` sends it to the other one itself."""
    async def run() -> None:
        actors, router, first = await _request_sent_to_replica_0()
        lost = router.replicas[0]
        if answer == "taken":  # draining, then its stream ended (as a scale-in does)
            await router.health.deliver(lost, [EngineHealth(healthy=False, reason="scaled in", draining=True)])
        else:
            lost.alive = False
        resume = asyncio.create_task(router.resumption.resume(router.inflight["a"], lost))
        await asyncio.sleep(0.02)
        assert not first.done() and not resume.done()  # it waits for the replica's answer
        if answer == "taken":
            actors[0].adds[0].set_result(1234)
        else:
            actors[0].adds[0].set_exception(ray.exceptions.RayActorError())
        await _until(lambda: actors[1].adds)
        actors[1].adds[0].set_result(1234)
        await asyncio.wait_for(resume, 1.0)
        moved = actors[1].requests[0]
        if answer == "taken":
            assert actors[0].aborted == ["a"] and moved.resume is not None and moved.resume.seed == 1234
        else:
            assert actors[0].aborted == [] and moved.resume is None
        assert len(actors[1].adds) == 1  # sent once, not by both the resume and generate
        await _finishes_on_replica_1(router, first)

    asyncio.run(run())


def test_a_request_a_draining_replica_refuses_goes_to_another():
    """Routed to a replica whose drain began before this gateway heard of it: the replica refuses it (so its drain
    never waits on, or cuts short, a request that came in late) and the other replica runs it from the start."""
    async def run() -> None:
        actors, router, first = await _request_sent_to_replica_0()
        actors[0].adds[0].set_exception(ray.exceptions.RayTaskError(
            "add_request", "", ReplicaDrainingError("model replica is draining: replaced by a rollout")))
        await _until(lambda: actors[1].adds)
        actors[1].adds[0].set_result(1234)
        assert actors[1].requests[0].resume is None and actors[0].aborted == []
        await _finishes_on_replica_1(router, first)

    asyncio.run(run())
