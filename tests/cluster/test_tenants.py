"""Priority and tenants through a real gateway over loopback (HTTP with the ``openai`` SDK and httpx, gRPC with the
client): each tenant's limits refuse its next request at once (429 with Retry-After, RESOURCE_EXHAUSTED with
retry-after metadata) while other tenants are let in, and every place is given back however a request ends; a
request's tenant is its key's, else the trusted header's, shown by the per-tenant metrics; priority reaches the
engine under ``--scheduling-policy priority``. The engine is frozen (SIGSTOP) where a request must stay without its
first token."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import grpc
import httpx2
import openai
import pytest
import ray

from pagedserve.cluster.client import build_request
from pagedserve.common.config import default_model_dir
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.core_types import Tenant
from pagedserve.proto.v1 import generation_pb2 as pb
from pagedserve.tests.server_thread import ServerThread, free_port

MODEL = "tiny-llama"
PLAIN_KEY, CHAT_KEY, BATCH_KEY = "plain-key", "sk-chat", "sk-batch"
TENANTS = {"tenants": [{"name": "chat", "api_key": CHAT_KEY, "weight": 2.0, "max_concurrent": 1},
                       {"name": "batch", "api_key": BATCH_KEY, "max_queued": 1}]}
HEADER = "x-tenant-id"
TEMPLATE = f"{default_model_dir()}/chat_template.jinja"


@pytest.fixture(scope="module")
def server(ray_cluster, llama_dir):
    srv = ServerThread(EngineArgs(model=llama_dir, seed=0, scheduling_policy="priority", fairness="tokens"),
                       http_port=free_port(), served_model_name=MODEL, chat_template=TEMPLATE, api_key=PLAIN_KEY,
                       tenants=json.dumps(TENANTS), tenant_header=HEADER.upper(), tenant_max_concurrent=8,
                       tenant_metrics_max_labels=2).start()
    yield srv
    srv.stop()


def _http(key: str = PLAIN_KEY, **headers) -> httpx2.Client:
    return httpx2.Client(headers={"Authorization": f"Bearer {key}", **headers}, timeout=30)


def _metric(server, name: str, **labels) -> float:
    text = httpx2.get(f"{server.http_url}/metrics").text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in want))


def _usage(server, tenant: str) -> tuple[int, int]:
    return server.gateway.state.tenants.usage(tenant)


def _wait_released(server, *tenants: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_usage(server, t) != (0, 0) for t in tenants):
        assert time.monotonic() < deadline, {t: _usage(server, t) for t in tenants}
        time.sleep(0.02)


@contextlib.contextmanager
def _frozen_engine(server):
    """The replica's engine-core actor stopped (SIGSTOP): a request sent now waits for its first output."""
    pid = ray.get(server.replicas[0].actor.pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _sent(server, field: str) -> list:
    """That field of every request the gateway has sent to the replicas and not seen finish, as sent."""
    return [getattr(rec.request, field) for rec in list(server.gateway.state.engine.inflight.values())]


def _body(**kw) -> dict:
    return {"model": MODEL, "prompt": "class", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **kw}


def test_each_tenant_is_refused_at_its_own_limit_while_the_others_are_let_in(server):
    """chat: one request in flight; batch: one without its first token. With the engine frozen, the second of each
    is refused at once over both protocols while the default tenant's is let in; once the first ones finish, both
    are let in again."""
    rejected = {(t, r): _metric(server, "pagedserve_tenant_rejected_requests_total", tenant=t, reason=r)
                for t in ("chat", "batch") for r in ("concurrent", "queued")}
    with _http(CHAT_KEY) as chat, _http(BATCH_KEY) as batch, _http() as plain, \
            server.client(api_key=CHAT_KEY) as grpc_chat, contextlib.ExitStack() as streams:
        with _frozen_engine(server):
            held = streams.enter_context(chat.stream("POST", f"{server.http_url}/v1/completions",
                                                     json=_body(stream=True, max_tokens=200, ignore_eos=True)))
            queued = streams.enter_context(batch.stream("POST", f"{server.http_url}/v1/completions",
                                                        json=_body(stream=True)))
            assert held.status_code == queued.status_code == 200  # let in, waiting for the engine
            assert _usage(server, "chat") == (1, 1) and _usage(server, "batch") == (1, 1)

            r = chat.post(f"{server.http_url}/v1/chat/completions",
                          json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"] == {"message": "tenant 'chat' is at its limit of 1 requests in flight "
                                                    "(--tenant-max-concurrent, or its max_concurrent); retry later",
                                         "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}
            with pytest.raises(grpc.RpcError) as err:
                grpc_chat.generate("class", max_tokens=2)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tenant 'chat'" in err.value.details()
            assert ("retry-after", "1") in tuple(err.value.trailing_metadata())
            r = batch.post(f"{server.http_url}/v1/completions", json=_body())
            assert r.status_code == 429 and r.headers["Retry-After"] == "1"
            assert "1 requests waiting for their first token" in r.json()["error"]["message"]
            other = streams.enter_context(plain.stream("POST", f"{server.http_url}/v1/completions",
                                                       json=_body(stream=True)))
            assert other.status_code == 200  # the default tenant is let in meanwhile
            sent = _sent(server, "tenant")
            assert len(sent) == 3 and set(sent) == {Tenant("batch", 1.0), Tenant("chat", 2.0), Tenant("default", 1.0)}
        for r in (held, queued, other):
            assert [line for line in r.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
        _wait_released(server, "chat", "batch", "default")
        assert batch.post(f"{server.http_url}/v1/completions", json=_body()).status_code == 200
        assert chat.post(f"{server.http_url}/v1/completions", json=_body()).json()["usage"]["completion_tokens"] == 4
        assert grpc_chat.generate("class", max_tokens=2).completion_tokens == 2
    assert _metric(server, "pagedserve_tenant_rejected_requests_total", tenant="chat", reason="concurrent") == \
        rejected["chat", "concurrent"] + 2
    assert _metric(server, "pagedserve_tenant_rejected_requests_total", tenant="batch", reason="queued") == \
        rejected["batch", "queued"] + 1
    assert _metric(server, "pagedserve_tenant_queue_time_seconds_count", tenant="batch") >= 2
    _wait_released(server, "chat", "batch", "default")


def test_every_way_a_request_ends_gives_its_place_back(server):
    """A stream dropped before its first token and one dropped midway, a whole response whose client times out, a
    gRPC call cancelled or aborted, requests the engine refuses (400): nothing stays counted."""
    with _http(CHAT_KEY) as chat, server.client(api_key=CHAT_KEY) as grpc_chat:
        with _frozen_engine(server):
            with chat.stream("POST", f"{server.http_url}/v1/completions", json=_body(stream=True)) as r:
                assert r.status_code == 200 and _usage(server, "chat") == (1, 1)
            _wait_released(server, "chat")
            with pytest.raises(httpx2.TimeoutException):
                chat.post(f"{server.http_url}/v1/completions", json=_body(), timeout=0.3)
            _wait_released(server, "chat")
            call = grpc_chat.stream("class", max_tokens=200, ignore_eos=True)
            deadline = time.monotonic() + 10
            while _usage(server, "chat") != (1, 1):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            call.cancel()
            _wait_released(server, "chat")
        with chat.stream("POST", f"{server.http_url}/v1/completions",
                         json=_body(stream=True, max_tokens=200)) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data: {"))
        _wait_released(server, "chat")
        stream = grpc_chat.stream("class", max_tokens=200, ignore_eos=True)
        rid = next(stream).request_id
        assert grpc_chat.abort(rid) and list(stream)[-1].completions[0].finish_reason == pb.FINISH_REASON_ABORT
        _wait_released(server, "chat")
        r = chat.post(f"{server.http_url}/v1/completions", json=_body(prompt="x " * 300))  # past max_model_len
        assert r.status_code == 400
        r = chat.post(f"{server.http_url}/v1/chat/completions",
                      json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10_000})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
        with pytest.raises(grpc.RpcError) as err:
            grpc_chat.generate("x", top_p=1.5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _usage(server, "chat") == (0, 0)


def test_a_requests_tenant_is_its_keys_else_the_headers(server):
    """The tenant header (configured as X-TENANT-ID: any case) names the tenant of a request whose key names none,
    over both protocols; a key's own tenant wins; a bad name is a 400 / INVALID_ARGUMENT. Past two header tenants,
    the metrics label them "other". An unknown key is still 401 / UNAUTHENTICATED."""
    def count(tenant: str) -> float:
        return _metric(server, "pagedserve_tenant_requests_total", tenant=tenant)

    before = {t: count(t) for t in ("default", "chat", "team-a", "team-b", "other")}
    with _http(**{"X-Tenant-Id": "team-a"}) as team_a, _http(CHAT_KEY, **{HEADER: "team-b"}) as chat:
        assert team_a.post(f"{server.http_url}/v1/completions", json=_body()).status_code == 200
        assert chat.post(f"{server.http_url}/v1/completions", json=_body()).status_code == 200
    with _http() as plain:
        assert plain.post(f"{server.http_url}/v1/completions", json=_body()).status_code == 200
        for bad in ("x" * 65, "a b", "other"):
            r = plain.post(f"{server.http_url}/v1/completions", json=_body(), headers={HEADER: bad})
            assert r.status_code == 400 and r.json()["error"]["message"].startswith("x-tenant-id: a tenant name is")
        for name in ("team-b", "team-c", "team-d"):
            assert plain.post(f"{server.http_url}/v1/completions", json=_body(),
                              headers={HEADER: name}).status_code == 200
        r = plain.post(f"{server.http_url}/v1/completions", json=_body(),
                       headers={"Authorization": "Bearer sk-unknown", HEADER: "team-a"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with server.client(api_key=PLAIN_KEY) as c:
        c.metadata.append((HEADER, "team-a"))
        assert c.generate("class", max_tokens=2).completion_tokens == 2
        with pytest.raises(grpc.RpcError) as err:
            list(c.stub.Generate(build_request("x", max_tokens=2), metadata=[*c.metadata[:1], (HEADER, "a b")]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and HEADER in err.value.details()
    with server.client(api_key="sk-unknown") as c, pytest.raises(grpc.RpcError) as err:
        c.generate("class", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    after = {t: count(t) for t in before}
    assert after["team-a"] == before["team-a"] + 2 and after["chat"] == before["chat"] + 1
    assert after["default"] == before["default"] + 1
    assert after["team-b"] == before["team-b"] + 1  # the second label
    assert after["other"] == before["other"] + 2  # team-c and team-d
    assert _metric(server, "pagedserve_tenant_prompt_tokens_total", tenant="team-a") > 0
    assert _metric(server, "pagedserve_tenant_generation_tokens_total", tenant="team-a") >= 6


def test_priority_reaches_the_priority_scheduler(server):
    """Under --scheduling-policy priority any priority is taken, and sent to the replica with the request: the SDK's
    extra_body over HTTP, the field over gRPC."""
    with _http() as h, server.client(api_key=PLAIN_KEY) as c:
        with _frozen_engine(server), h.stream("POST", f"{server.http_url}/v1/completions",
                                              json=_body(stream=True, priority=5)) as r:
            call = c.stream("class", max_tokens=2, priority=-7)
            deadline = time.monotonic() + 10
            while len(_sent(server, "priority")) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert r.status_code == 200 and sorted(_sent(server, "priority")) == [-7, 5]
        assert list(call)[-1].usage.completion_tokens == 2
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=PLAIN_KEY, max_retries=0, timeout=60) as sdk:
        for priority in (-5, 0, 7):
            got = sdk.completions.create(model=MODEL, prompt="class", max_tokens=3, temperature=0.0,
                                         extra_body={"priority": priority})
            assert got.usage.completion_tokens == 3
        chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                           extra_body={"priority": 3})
        assert chat.usage.completion_tokens == 2
        with pytest.raises(openai.BadRequestError) as err:
            sdk.completions.create(model=MODEL, prompt="class", max_tokens=3, extra_body={"priority": 2**31})
        assert err.value.body["param"] == "priority"
    with server.client(api_key=PLAIN_KEY) as c:
        assert c.generate("class", max_tokens=3, priority=-(2**31)).completion_tokens == 3
