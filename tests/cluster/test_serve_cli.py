"""`pagedserve serve` as a real process joined to the session's Ray cluster: the client CLI, then a SIGTERM
drain (health NOT_SERVING, new requests refused, the running one finishes, actors released, exit 0)."""
from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading

import grpc
import psutil
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.client import Client
from pagedserve.tests.server_thread import free_port, kill_ray_head

PS = [sys.executable, "-m", "pagedserve"]


def _wait_health(client: Client, want: str, proc: subprocess.Popen, timeout: float = 120.0) -> list[str]:
    def alive() -> None:
        assert proc.poll() is None, proc.stderr.read()

    return client.wait_for_health(want, timeout, check=alive)


def test_serve_process_client_cli_and_sigterm_drain(ray_cluster, llama_dir):
    port = free_port()
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    proc = subprocess.Popen(PS + ["serve", llama_dir, "--host", "127.0.0.1", "--grpc-port", str(port),
                                  "--port", str(free_port()), "--drain-timeout", "60"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    target = f"127.0.0.1:{port}"
    try:
        with Client(target, timeout=5) as c:
            _wait_health(c, "SERVING", proc)
        cli = subprocess.run(PS + ["client", "--server", target, "--stream", "def paged(block", "--max-tokens", "12"],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        llm = LLM(llama_dir, seed=0)
        exp = llm.generate("def paged(block", SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
        assert cli.stdout == "def paged(block" + exp.outputs[0].text + "\n"
        bad = subprocess.run(PS + ["client", "--server", target, "x", "--max-tokens", "100000"],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "max_model_len" in bad.stderr

        with Client(target) as c:
            stream = c.stream("class", max_tokens=120, temperature=0.0, ignore_eos=True)
            first = next(stream)
            tokens = [len(first.completions[0].token_ids)]
            rest = threading.Thread(target=lambda: tokens.extend(len(r.completions[0].token_ids) for r in stream))
            rest.start()
            proc.send_signal(signal.SIGTERM)
            _wait_health(c, "NOT_SERVING", proc, timeout=10)
            with pytest.raises(grpc.RpcError) as err:
                c.generate("def", max_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
            rest.join(60)
        assert sum(tokens) == 120  # the running request finished during the drain
        assert proc.wait(60) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    leftover = [pg for pg in ray_cluster.util.placement_group_table().values() if pg["state"] == "CREATED"]
    assert not leftover, leftover


def test_demo_command_on_the_bundled_model(ray_cluster):
    """The README's main job (`pagedserve demo`), here joined to the session's Ray cluster."""
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    proc = subprocess.run(PS + ["demo", "--max-tokens", "24"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gateway SERVING" in proc.stderr
    for i in range(4):
        assert f"[{i}] " in proc.stdout
    assert "[4 requests, 96 tokens in" in proc.stdout and "shut down cleanly" in proc.stdout
    assert "def __init__(self" in proc.stdout


def _non_loopback_ipv4() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


def test_serve_refuses_a_ray_cluster_exposed_without_authentication(llama_dir, tmp_path):
    """A head on a non-loopback address with token auth off: `serve` exits 2 naming the fix, before placing
    anything (a loopback head, as in every other test, is allowed)."""
    ip = _non_loopback_ipv4()
    if ip is None:
        pytest.skip("no non-loopback IPv4 address on this machine")
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    bin_dir = os.path.dirname(sys.executable)
    gcs_port = free_port()
    ports = [f"--{name}={free_port()}" for name in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                       "metrics-export-port", "runtime-env-agent-port",
                                                       "ray-client-server-port", "node-manager-port",
                                                       "object-manager-port")]
    temp_dir = tempfile.mkdtemp(prefix="ra", dir="/tmp")  # short: Ray's socket paths have a length limit
    head = subprocess.Popen([os.path.join(bin_dir, "ray"), "start", "--head", f"--node-ip-address={ip}",
                             f"--port={gcs_port}", *ports, "--num-cpus=1", "--include-dashboard=false", "--block",
                             "--disable-usage-stats", f"--temp-dir={temp_dir}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc = subprocess.run(PS + ["serve", llama_dir, "--ray-address", f"{ip}:{gcs_port}", "--port", "0",
                                    "--grpc-port", "0", "--metrics-port", "0"],
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "token authentication off" in proc.stderr and "--allow-unauthenticated-ray" in proc.stderr
    finally:
        kill_ray_head(head, temp_dir)
