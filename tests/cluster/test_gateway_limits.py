"""The gateway's request path under hostile or heavy use, over loopback with real gRPC and HTTP clients: request ids
that clients choose are suffixed by the server (two clients sharing one never collide); with several API keys an
Abort reaches only its own key's requests; /metrics answers from a snapshot while the engine is frozen; bodies over
the cap are 413 before they are read; past the concurrency caps gRPC says RESOURCE_EXHAUSTED and HTTP 503, and
both serve again after; a bug answers INTERNAL / 500 with an error id, its detail only in the log."""
from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
import time

import grpc
import httpx2
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.proto.v1 import generation_pb2 as pb
from pagedserve.tests.server_thread import ServerThread, free_port, start_in_background

MODEL = "tiny-llama"
KEY_A, KEY_B = "key-a", "key-b"
MAX_CONCURRENT = 4
SUFFIX = re.compile(r"-[0-9a-f]{16}$")


@pytest.fixture(scope="module")
def server(ray_cluster, llama_dir):
    srv = ServerThread(EngineArgs(model=llama_dir, seed=0), http_port=free_port(), metrics_port=free_port(),
                       served_model_name=MODEL, api_key=f"{KEY_A},{KEY_B}",
                       max_concurrent_requests=MAX_CONCURRENT).start()
    yield srv
    srv.stop()


def _http(key: str = KEY_A, **kw) -> httpx2.Client:
    return httpx2.Client(headers={"Authorization": f"Bearer {key}"}, timeout=30, **kw)


def _value(text: str, name: str, **labels) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in want))


def _scrape(url: str) -> tuple[float, str]:
    t = time.monotonic()
    text = httpx2.get(url, timeout=30).text
    return time.monotonic() - t, text


def _wait_idle(server, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    with server.client(api_key=KEY_A) as c:
        while (info := c.model_info()).num_running_requests or info.kv_cache_usage:
            assert time.monotonic() < deadline, f"KV blocks not freed: {info}"
            time.sleep(0.05)


def _completion_stream(url: str, body: dict, key: str = KEY_A):
    """The chunks of a streamed completion, as they come."""
    with _http(key) as c, c.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                yield line


def test_client_request_ids_are_suffixed_and_never_collide(server):
    long = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    with server.client(api_key=KEY_A) as a, server.client(api_key=KEY_B) as b:
        first, second = a.stream("class", request_id="same", **long), b.stream("def", request_id="same", **long)
        r1, r2 = next(first), next(second)  # both running at once under the one id the clients chose
        assert SUFFIX.sub("", r1.request_id) == SUFFIX.sub("", r2.request_id) == "same"
        assert r1.request_id != r2.request_id
        assert not a.abort("same") and not b.abort("same")  # the bare client id reaches neither
        for r, rest in ((r1, first), (r2, second)):
            responses = [r, *rest]
            assert {x.request_id for x in responses} == {r.request_id}
            assert responses[-1].usage.completion_tokens == 40
        assert a.generate("x", request_id="r" * 256, max_tokens=1).request_id.startswith("r" * 256 + "-")
        for bad in ("r" * 257, "two\nlines"):
            with pytest.raises(grpc.RpcError) as err:
                a.generate("x", request_id=bad, max_tokens=1)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.value.details()

    body = dict(model=MODEL, prompt="class", request_id="same", temperature=0.0, max_tokens=30, ignore_eos=True)
    stream = _completion_stream(server.http_url, body)
    chunk = next(stream)  # running: a second request under the same client id runs beside it
    with _http(KEY_B) as c:
        other = c.post(f"{server.http_url}/v1/completions", json={**body, "stream": False})
        too_long = c.post(f"{server.http_url}/v1/completions", json={**body, "request_id": "r" * 257})
    assert other.status_code == 200 and re.fullmatch(r"cmpl-same-[0-9a-f]{16}", other.json()["id"])
    streamed_id = re.search(r'"id":"([^"]+)"', chunk).group(1)
    assert streamed_id.startswith("cmpl-same-") and streamed_id != other.json()["id"]
    assert len(list(stream)) >= 29  # not disturbed
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "request_id"
    _wait_idle(server)


def test_abort_reaches_only_the_same_keys_requests(server):
    long = dict(temperature=0.0, max_tokens=200, ignore_eos=True)
    with server.client(api_key=KEY_A) as a, server.client(api_key=KEY_B) as b:
        stream = a.stream("class", **long)
        rid = next(stream).request_id
        assert not b.abort(rid)  # another key's request: "not found", exactly as an unknown id
        assert not a.abort("no-such-request") and not b.abort("no-such-request")
        assert a.abort(rid)
        responses = list(stream)
        assert responses[-1].completions[0].finish_reason == pb.FINISH_REASON_ABORT

        # An HTTP request is owned by its key too (its engine id: the response id without "cmpl-").
        chunks = _completion_stream(server.http_url, dict(model=MODEL, prompt="def", **long), key=KEY_B)
        rid = re.search(r'"id":"cmpl-([^"]+)"', next(chunks)).group(1)
        assert not a.abort(rid)
        assert b.abort(rid)
        assert '"finish_reason":"abort"' in list(chunks)[-1]
    _wait_idle(server)


def test_metrics_answer_from_a_snapshot_while_the_engine_is_frozen(server):
    """The engines' series are at most ~1 s old while the engine answers; with its actor frozen (SIGSTOP, so that
    a call to it waits) a scrape on either port still answers at once, the gateway's own series stay current, and
    the snapshot's age says how stale the engines' are."""
    metrics_url = f"http://127.0.0.1:{server.gateway.metrics_port}/metrics"
    http_metrics_url = f"{server.http_url}/metrics"
    scheduled = "pagedserve_scheduled_tokens_total"
    with server.client(api_key=KEY_A) as c:
        before = _value(_scrape(metrics_url)[1], scheduled)
        c.generate("class", temperature=0.0, max_tokens=20, ignore_eos=True)
        done = time.monotonic()
        while _value(_scrape(metrics_url)[1], scheduled) < before + 20:
            assert time.monotonic() - done < 1.5, "the engines' series are more than ~1 s stale"
            time.sleep(0.05)

        pid = ray.get(server.replicas[0].actor.pid.remote())
        stream = c.stream("def", temperature=0.0, max_tokens=100, ignore_eos=True)
        next(stream)
        os.kill(pid, signal.SIGSTOP)
        try:
            frozen = time.monotonic()
            took, text = _scrape(metrics_url)
            latencies, ages = [took], []
            errors = _value(text, "pagedserve_request_errors_total", protocol="grpc", code="INVALID_ARGUMENT")
            with pytest.raises(grpc.RpcError):
                c.generate("x", top_p=1.5)  # refused by the gateway: its own series move at once
            while time.monotonic() - frozen < 2.5:
                for url in (metrics_url, http_metrics_url):
                    took, text = _scrape(url)
                    latencies.append(took)
                    ages.append(_value(text, "pagedserve_engine_metrics_age_seconds", model_name=MODEL))
                    assert _value(text, "pagedserve_request_errors_total", protocol="grpc",
                                  code="INVALID_ARGUMENT") == errors + 1
                time.sleep(0.1)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert max(latencies) < 0.5, f"a scrape waited {max(latencies):.2f} s on the frozen engine"
        assert max(ages) > 1.5  # stale, and saying so
        assert list(stream)[-1].usage.completion_tokens == 100
    thawed = time.monotonic()
    while _value(_scrape(metrics_url)[1], "pagedserve_engine_metrics_age_seconds") > 1.0:
        assert time.monotonic() - thawed < 10, "the snapshot was not refreshed after the engine came back"
        time.sleep(0.1)
    _wait_idle(server)


def _status_line(sock: socket.socket, timeout: float) -> str:
    sock.settimeout(timeout)
    data = b""
    while b"\r\n" not in data:
        more = sock.recv(4096)
        assert more, "connection closed without a response"
        data += more
    return data.split(b"\r\n", 1)[0].decode()


def test_oversized_body_is_413_before_it_is_read_while_a_stream_flows(server):
    host, port = "127.0.0.1", int(server.http_url.rsplit(":", 1)[1])
    gaps, done = [], threading.Event()
    body = dict(model=MODEL, prompt="class", max_tokens=200, temperature=0.0, ignore_eos=True)

    def stream() -> None:
        last = time.monotonic()
        for _ in _completion_stream(server.http_url, body):
            gaps.append(time.monotonic() - last)
            last = time.monotonic()
        done.set()

    t = start_in_background(stream, until=lambda: bool(gaps))
    cap = server.gateway.state.max_body_bytes
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY_A}\r\n"
            "Content-Type: application/json\r\n")
    # Declared over the cap: refused on the headers, none of the 8 MB sent.
    with socket.create_connection((host, port)) as s:
        t0 = time.monotonic()
        s.sendall(f"{head}Content-Length: {8 << 20}\r\n\r\n".encode() + b'{"prompt": "')
        assert _status_line(s, 5).split()[1] == "413"
        assert time.monotonic() - t0 < 2
    # Chunked, no length: refused once past the cap, before the body ends.
    with socket.create_connection((host, port)) as s:
        s.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"x" * (64 << 10)
        for _ in range(cap // len(chunk) + 2):
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert _status_line(s, 5).split()[1] == "413"
    with _http() as c:
        ok = c.post(f"{server.http_url}/v1/completions", json={**body, "max_tokens": 2})
    assert ok.status_code == 200
    t.join(60)
    assert done.is_set() and len(gaps) >= 100 and max(gaps[1:]) < 1.0, max(gaps[1:])


def test_concurrency_caps_refuse_then_serve_again(server):
    """gRPC runs at most max_concurrent_requests + 64 RPCs (held here by health Watch streams, which the gateway
    does not count itself); the next gets RESOURCE_EXHAUSTED. HTTP serves at most max_concurrent_requests + 128
    connections; on the next, uvicorn answers 503. Both serve again once the holders go."""
    cap = MAX_CONCURRENT + 64
    with grpc.insecure_channel(server.target) as ch, server.client(api_key=KEY_A) as c:
        watch = health_pb2_grpc.HealthStub(ch).Watch
        watches = [watch(health_pb2.HealthCheckRequest()) for _ in range(cap)]
        for w in watches:
            assert next(w).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            c.tokenize("class")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for w in watches:
            w.cancel()
        deadline = time.monotonic() + 10
        while True:
            try:
                assert c.generate("class", max_tokens=2).completion_tokens == 2
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.05)

    host, port = "127.0.0.1", int(server.http_url.rsplit(":", 1)[1])
    idle = [socket.create_connection((host, port)) for _ in range(MAX_CONCURRENT + 128)]
    try:
        deadline = time.monotonic() + 10
        while (r := httpx2.get(f"{server.http_url}/health")).status_code != 503:
            assert r.status_code == 200 and time.monotonic() < deadline, r.status_code
            time.sleep(0.05)
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while (r := httpx2.get(f"{server.http_url}/health")).status_code != 200:
        assert time.monotonic() < deadline, r.status_code
        time.sleep(0.05)


def test_a_bug_is_internal_with_an_error_id_and_the_detail_only_in_the_log(server, monkeypatch, caplog):
    engine = server.gateway.state.engine

    def boom(*args, **kwargs):
        raise RuntimeError("/srv/secret-tenant/model")

    monkeypatch.setattr(engine, "get_stats", boom)
    monkeypatch.setattr(engine, "process", boom)
    with caplog.at_level(logging.ERROR, logger="pagedserve.cluster.server.internal_errors"):
        messages = []
        with server.client(api_key=KEY_A) as c:
            for call in (c.model_info, lambda: c.generate("class", max_tokens=2)):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.INTERNAL
                messages.append(err.value.details())
        with _http() as h:
            r = h.post(f"{server.http_url}/v1/completions", json=dict(model=MODEL, prompt="class", max_tokens=2))
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        messages.append(r.json()["error"]["message"])
    logged = [rec for rec in caplog.records if rec.name == "pagedserve.cluster.server.internal_errors"]
    for message in messages:
        assert "secret" not in message
        error_id = re.fullmatch(r"internal error \(id ([0-9a-f]{16})\); the server's log has the detail",
                                message).group(1)
        [record] = [rec for rec in logged if error_id in rec.getMessage()]
        assert "secret-tenant" in repr(record.exc_info[1])
