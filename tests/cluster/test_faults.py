"""Faults under a tensor-parallel (TP=2) replica behind the real gateway, caused with real signals: a worker that
freezes (SIGSTOP: its step hangs in the all-reduce until the step watchdog restarts the engine) and an engine-core
actor that is killed (SIGKILL: Ray restarts it, its workers are rebuilt). Each time the stream in flight resumes and
ends with exactly the greedy tokens, health says NOT_SERVING while the engine cannot serve and SERVING after, and no
process of the old engine is left."""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import ray

from pagedserve import LLM, SamplingParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.tests.server_thread import HealthWatch, ServerThread

STEP_TIMEOUT = 4.0
MAX_TOKENS = 100


@pytest.fixture(scope="module")
def model_dir(model_factory) -> str:
    return model_factory("gpt2")


@pytest.fixture(scope="module")
def expected(model_dir) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return LLM(model_dir, seed=0).generate("class", params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def server(ray_cluster, model_dir):
    srv = ServerThread(EngineArgs(model=model_dir, tensor_parallel_size=2, seed=0), step_timeout=STEP_TIMEOUT).start()
    yield srv
    srv.stop()


def _stream_through(srv: ServerThread, fault) -> list[int]:
    """Start a greedy stream, apply ``fault`` after its first response, return all the tokens it streamed."""
    with srv.client() as c:
        stream = c.stream("class", max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        responses = [next(stream)]
        fault()
        responses += list(stream)
    assert responses[-1].finished and responses[-1].usage.completion_tokens == MAX_TOKENS
    return [t for r in responses for comp in r.completions for t in comp.token_ids]


def _gone(pids: list[int]) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_frozen_worker_is_caught_by_the_step_watchdog(server, expected):
    actor = server.replicas[0].actor
    old = ray.get(actor.worker_pids.remote())
    restarts = ray.get(actor.get_stats.remote()).num_worker_restarts
    with HealthWatch(server) as health:
        t0 = time.monotonic()
        tokens = _stream_through(server, lambda: os.kill(old[1], signal.SIGSTOP))
        took = time.monotonic() - t0
    assert tokens == expected
    assert STEP_TIMEOUT < took < STEP_TIMEOUT + 60
    assert health.seen[0] == "SERVING" and "NOT_SERVING" in health.seen and health.seen[-1] == "SERVING", health.seen
    assert ray.get(actor.get_stats.remote()).num_worker_restarts == restarts + 1
    new = ray.get(actor.worker_pids.remote())
    assert set(new).isdisjoint(old) and _gone(old)


def test_killed_engine_core_actor_resumes_on_its_restart(server, expected):
    actor = server.replicas[0].actor
    actor_pid = ray.get(actor.pid.remote())
    old = [actor_pid, *ray.get(actor.worker_pids.remote())]
    with HealthWatch(server) as health:
        tokens = _stream_through(server, lambda: os.kill(actor_pid, signal.SIGKILL))
    assert tokens == expected
    assert health.seen[0] == "SERVING" and "NOT_SERVING" in health.seen and health.seen[-1] == "SERVING", health.seen
    new = [ray.get(actor.pid.remote()), *ray.get(actor.worker_pids.remote())]
    assert set(new).isdisjoint(old)
    deadline = time.monotonic() + 30
    while not _gone(old):  # the dead actor's workers go with their owner
        assert time.monotonic() < deadline, [p for p in old if psutil.pid_exists(p)]
        time.sleep(0.5)
    with server.client(timeout=10) as c:
        info = c.model_info()
        assert info.num_running_requests == 0 and info.num_free_kv_blocks == info.num_kv_blocks
