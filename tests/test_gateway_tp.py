"""The gateway in front of a tensor-parallel replica (TP=2 worker actors): outputs equal the offline engine, and a
worker that dies mid-stream gives UNAVAILABLE, after which the rebuilt group serves again."""
from __future__ import annotations

import os
import signal

import grpc
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


def test_worker_death_is_unavailable_then_group_is_rebuilt(tp_server):
    actor = tp_server.replicas[0].actor
    pids = ray.get(actor.worker_pids.remote())
    assert len(pids) == 2
    with tp_server.client() as c:
        stream = c.stream("class", max_tokens=200, temperature=0.0, ignore_eos=True)
        next(stream)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "workers failed" in err.value.details()
        assert c.generate("class", max_tokens=4, temperature=0.0).completion_tokens == 4
        info = c.model_info()
        assert info.num_running_requests == 0 and info.kv_cache_usage == 0.0
    assert ray.get(actor.get_stats.remote()).num_worker_restarts == 1
    assert set(ray.get(actor.worker_pids.remote())).isdisjoint(pids)
