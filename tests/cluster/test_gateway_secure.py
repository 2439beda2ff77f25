"""API key, TLS, a full waiting queue, and an engine-core actor that dies: each gets its status code (a stream
whose actor died resumes on the restarted one), and the server keeps serving."""
from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
import ray

from pagedserve import LLM, SamplingParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.tests.server_thread import ServerThread

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def secure(ray_cluster, llama_dir, tls_files):
    cert, key = tls_files
    root = open(cert, "rb").read()
    srv = ServerThread(EngineArgs(model=llama_dir, seed=0, max_num_seqs=1), api_key=KEY, ssl_certfile=cert,
                       ssl_keyfile=key, max_waiting_requests=1)
    srv.start(root_certificates=root)
    srv.root = root
    yield srv
    srv.stop()


def test_api_key_required(secure):
    with secure.client(root_certificates=secure.root) as c:
        assert c.health() == "SERVING"  # probes need no key
        with pytest.raises(grpc.RpcError) as err:
            c.generate("class", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            c.tokenize("class")
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with secure.client(root_certificates=secure.root, api_key="wrong") as c:
        with pytest.raises(grpc.RpcError) as err:
            c.model_info()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with secure.client(root_certificates=secure.root, api_key=KEY) as c:
        assert c.generate("class", max_tokens=2, temperature=0.0).completion_tokens == 2


def test_plaintext_client_cannot_talk_to_tls_server(secure):
    with secure.client(api_key=KEY, timeout=3) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.model_info()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_full_queue_is_resource_exhausted(secure):
    with secure.client(root_certificates=secure.root, api_key=KEY) as c:
        long = dict(max_tokens=150, temperature=0.0, ignore_eos=True)
        running = c.stream("class", **long)
        next(running)  # running now; max_num_seqs=1 keeps the next one waiting
        waiting = c.stream("def", **long)
        deadline = time.monotonic() + 20
        while c.model_info().num_waiting_requests < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as err:
            c.generate("import", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "waiting queue is full" in err.value.details()
        assert sum(len(r.completions[0].token_ids) for r in running) == 149
        assert sum(len(r.completions[0].token_ids) for r in waiting) == 150
        assert c.generate("import", max_tokens=2, temperature=0.0).completion_tokens == 2


def test_engine_core_actor_death_resumes_the_stream_exactly(secure, llama_dir):
    """SIGKILL the engine-core actor mid-stream: Ray restarts it, and the stream goes on there from the tokens it
    had streamed (greedy: exactly the offline tokens). Meanwhile health is NOT_SERVING and new requests get
    UNAVAILABLE at once; afterwards SERVING again."""
    replica = secure.replicas[0]
    pid = ray.get(replica.actor.pid.remote())
    with secure.client(root_certificates=secure.root, api_key=KEY) as c:
        stream = c.stream("class", max_tokens=150, temperature=0.0, ignore_eos=True)
        responses = [next(stream)]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while c.health() != "NOT_SERVING":  # the gateway notices the death quickly
            assert time.monotonic() < deadline, "health stayed SERVING with the engine dead"
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as err:
            c.generate("import", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        responses += list(stream)
        assert c.health() == "SERVING"
        assert c.generate("class", max_tokens=3, temperature=0.0).completion_tokens == 3
    tokens = [t for r in responses for comp in r.completions for t in comp.token_ids]
    llm = LLM(llama_dir, seed=0)
    exp = llm.generate("class", SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True), use_tqdm=False)
    assert tokens == exp[0].outputs[0].token_ids
    assert responses[-1].finished and responses[-1].usage.completion_tokens == 150
    assert ray.get(replica.actor.pid.remote()) != pid
