"""Gateways that scale out, as real processes: `serve --api-server-count 2` (two gateway processes on the same gRPC
and HTTP ports, attached to the same named replicas), one of them SIGKILLed under concurrent streams, and
`pagedserve gateway --ray-address` attached to the running cluster's replicas."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import httpx2
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.client import Client
from pagedserve.cluster.client.request import build_request
from pagedserve.proto.v1 import generation_pb2_grpc as pb_grpc
from pagedserve.tests.server_thread import free_port, free_ports_in_a_row

PS = [sys.executable, "-m", "pagedserve"]
MODEL = "gwtest"
NAMESPACE = "pagedserve"
STREAMS = 200  # concurrent streams at the kill
MAX_TOKENS = 64
PROMPTS = ["def paged(block", "class Scheduler:", "import torch\n", "for i in range(", "return self.", "# KV cache"]
GATEWAY_HEADER = "x-pagedserve-gateway"


def _pid(response: httpx2.Response) -> int:
    return int(response.headers[GATEWAY_HEADER].rsplit("/", 1)[1])


class Cluster:
    def __init__(self, proc: subprocess.Popen, port: int, http_port: int, metrics_port: int) -> None:
        self.proc, self.port, self.http_port, self.metrics_port = proc, port, http_port, metrics_port
        self.url = f"http://127.0.0.1:{http_port}"

    def gateway_pids(self, tries: int = 40) -> set[int]:
        pids = set()
        for _ in range(tries):  # a new connection each: the kernel spreads them over the gateways
            with httpx2.Client(timeout=10) as c:
                pids.add(_pid(c.get(self.url + "/v1/models")))
        return pids

    def metrics(self, i: int) -> str:
        return httpx2.get(f"http://127.0.0.1:{self.metrics_port + i}/metrics", timeout=10).text


@pytest.fixture(scope="module")
def cluster(ray_cluster, llama_dir):
    port, http_port, metrics_port = free_port(), free_port(), free_ports_in_a_row(2)
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    proc = subprocess.Popen(PS + ["serve", "--model", llama_dir, "--host", "127.0.0.1", "--grpc-port", str(port),
                                  "--port", str(http_port), "--metrics-port", str(metrics_port),
                                  "--served-model-name", MODEL, "--api-server-count", "2", "--drain-timeout", "10"],
                            env=env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    c = Cluster(proc, port, http_port, metrics_port)
    c.log = lines
    try:
        deadline = time.monotonic() + 180
        while True:  # both gateways SERVING: each one's metrics endpoint up and its health reached
            assert proc.poll() is None, "".join(lines)[-3000:]
            try:
                if len(c.gateway_pids(8)) == 2:
                    break
            except (httpx2.TransportError, KeyError):
                pass
            assert time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.5)
        yield c
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines)[-3000:]
        assert not [a for a in ray_cluster.util.list_named_actors(all_namespaces=True)
                    if a["namespace"] == NAMESPACE], "replicas left behind"
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def expected(llama_dir) -> dict[str, str]:
    llm = LLM(llama_dir, seed=0)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}


def _kv_all_free(ray) -> bool:
    actor = ray.get_actor(f"{MODEL}-replica-0", namespace=NAMESPACE)
    stats = ray.get(actor.get_stats.remote(), timeout=10)
    return stats.num_running == 0 and stats.kv_blocks_free == stats.kv_blocks_total


def test_two_gateway_processes_share_the_grpc_and_http_ports(cluster):
    assert len(cluster.gateway_pids()) == 2, "".join(cluster.log)[-3000:]
    for _ in range(16):  # a connection each (channels share one unless their subchannel pool is their own)
        with grpc.insecure_channel(f"127.0.0.1:{cluster.port}", [("grpc.use_local_subchannel_pool", 1)]) as ch:
            assert list(pb_grpc.GenerationServiceStub(ch).Generate(build_request("def", max_tokens=2), timeout=30))
    finished = re.compile(r'pagedserve_requests_finished_total\{[^}]*finish_reason="length"[^}]*protocol="grpc"'
                          r'[^}]*\} (\S+)')
    for i in range(2):  # each gateway took some of the gRPC connections
        text = cluster.metrics(i)
        assert sum(float(v) for v in finished.findall(text)) > 0, text[:2000]
    # The replicas' own series come from gateway 0 alone, so summing over the gateways counts them once.
    assert "pagedserve_workers_up" in cluster.metrics(0) and "pagedserve_workers_up" not in cluster.metrics(1)


def _stream(url: str, prompt: str, out: dict) -> None:
    body = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, stream=True, ignore_eos=True)
    text = []
    try:
        with httpx2.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            out["pid"] = _pid(r)
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text.append(json.loads(line[6:])["choices"][0]["text"])
                    out["started"] = True
        out["text"] = "".join(text)
    except httpx2.TransportError as e:
        out["error"] = e
    out["ended"] = time.monotonic()


def test_sigkilled_gateway_ends_only_its_streams_and_is_restarted(cluster, expected, ray_cluster):
    results = [{} for _ in range(STREAMS)]
    threads = [threading.Thread(target=_stream, args=(cluster.url, PROMPTS[i % len(PROMPTS)], results[i]))
               for i in range(STREAMS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(r.get("started") or "ended" in r for r in results):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pids = {r["pid"] for r in results if "pid" in r}
    assert len(pids) == 2, (pids, "".join(cluster.log)[-3000:])
    victim = min(pids)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()

    ok = 0
    new_deadline = killed + 5
    while ok < 5:  # new requests are answered (by the surviving gateway) within 5 s
        assert time.monotonic() < new_deadline, "no new request succeeded within 5 s of the kill"
        try:
            r = httpx2.post(cluster.url + "/v1/completions", timeout=5,
                            json=dict(model=MODEL, prompt="x", max_tokens=2, temperature=0.0))
            ok += r.status_code == 200
        except httpx2.TransportError:
            pass
    for t in threads:
        t.join(90)
        assert not t.is_alive(), "a stream hung"
    for i, r in enumerate(results):
        if r["pid"] == victim:
            assert "error" in r and r["ended"] - killed < 5, r
        else:
            assert "error" not in r, r
            assert r["text"] == expected[PROMPTS[i % len(PROMPTS)]]

    deadline = time.monotonic() + 60
    while True:  # the supervisor started a new gateway process in the victim's place
        pids_now = cluster.gateway_pids(12)
        if len(pids_now) == 2 and victim not in pids_now:
            break
        assert time.monotonic() < deadline, pids_now
        time.sleep(0.5)
    assert any("restarting it" in line for line in cluster.log)

    deadline = time.monotonic() + 60
    while not _kv_all_free(ray_cluster):  # the dead gateway's requests were aborted or ran out: no block held
        assert time.monotonic() < deadline
        time.sleep(0.5)


def test_gateway_command_attaches_to_the_running_replicas(cluster, expected, ray_cluster, llama_dir):
    port = free_port()
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    proc = subprocess.Popen(PS + ["gateway", "--served-model-name", MODEL, "--host", "127.0.0.1",
                                  "--grpc-port", str(port), "--port", "0", "--metrics-port", "0"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with Client(f"127.0.0.1:{port}", timeout=30) as c:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, proc.stderr.read()[-3000:]
                try:
                    if c.health() == "SERVING":
                        break
                except Exception:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.3)
            out = c.generate(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            assert out.text == expected[PROMPTS[0]]
            assert c.model_info().model_name == MODEL
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_refuses_a_gateway_metrics_port_that_is_taken(llama_dir):
    """Gateway i serves /metrics on --metrics-port + i; one taken is refused before anything starts (a gateway that
    cannot bind it would only fail and be restarted, over and over)."""
    first = free_ports_in_a_row(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first + 1))
        taken.listen()
        res = subprocess.run(PS + ["serve", "--model", llama_dir, "--host", "127.0.0.1", "--port", "0",
                                   "--metrics-port", str(first), "--api-server-count", "2"],
                             capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"--metrics-port + 1 = {first + 1}, which is taken" in res.stderr, res.stderr[-3000:]
