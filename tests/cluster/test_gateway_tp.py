"""The gateway in front of a tensor-parallel replica (TP=2 worker actors): outputs equal the offline engine, and a
worker that dies mid-stream is replaced while the stream goes on to exactly its tokens, health telling the truth."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

from pagedserve import LLM, SamplingParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.tests.server_thread import ServerThread


@pytest.fixture(scope="module")
def tp_server(ray_cluster, model_factory):
    srv = ServerThread(EngineArgs(model=model_factory("gpt2"), tensor_parallel_size=2, seed=0)).start()
    yield srv
    srv.stop()


def test_tp2_server_equals_offline(tp_server, model_factory):
    prompts = ["class self", "def paged(block", "import data"]
    with tp_server.client() as c:
        got = [c.generate(p, max_tokens=12, temperature=0.0).text for p in prompts]
        assert c.model_info().tensor_parallel_size == 2
    llm = LLM(model_factory("gpt2"), seed=0)
    exp = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12),
                                                   use_tqdm=False)]
    assert got == exp


def test_worker_death_mid_stream_resumes_exactly(tp_server, model_factory):
    actor = tp_server.replicas[0].actor
    pids = ray.get(actor.worker_pids.remote())
    assert len(pids) == 2
    health: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        with tp_server.client(timeout=2) as h:
            while not stop.is_set():
                status = h.health()
                if not health or health[-1] != status:
                    health.append(status)
                time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with tp_server.client() as c:
            stream = c.stream("class", max_tokens=120, temperature=0.0, ignore_eos=True)
            first = next(stream)
            os.kill(pids[1], signal.SIGKILL)
            rest = list(stream)
            tokens = [t for r in [first, *rest] for comp in r.completions for t in comp.token_ids]
            info = c.model_info()
            assert info.num_running_requests == 0 and info.kv_cache_usage == 0.0
    finally:
        stop.set()
        watcher.join()
    llm = LLM(model_factory("gpt2"), seed=0)
    exp = llm.generate("class", SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True), use_tqdm=False)
    assert tokens == exp[0].outputs[0].token_ids  # the stream ended with exactly its tokens, none twice
    assert rest[-1].completions[0].finish_reason != 0 and rest[-1].finished
    assert health[0] == "SERVING" and "NOT_SERVING" in health and health[-1] == "SERVING", health
    assert ray.get(actor.get_stats.remote()).num_worker_restarts == 1
    assert set(ray.get(actor.worker_pids.remote())).isdisjoint(pids)
