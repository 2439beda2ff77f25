"""`pagedserve serve` as a real process joined to the session's Ray cluster: the client CLI, then a SIGTERM
drain (health NOT_SERVING, new requests refused, the running one finishes, actors released, exit 0)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import grpc
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.client import Client
from pagedserve.tests.server_thread import free_port

PS = [sys.executable, "-m", "pagedserve"]


def _wait_health(client: Client, want: str, proc: subprocess.Popen, timeout: float = 120.0) -> list[str]:
    def alive() -> None:
        assert proc.poll() is None, proc.stderr.read()

    return client.wait_for_health(want, timeout, check=alive)


def test_serve_process_client_cli_and_sigterm_drain(ray_cluster, llama_dir):
    port = free_port()
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    proc = subprocess.Popen(PS + ["serve", "--model", llama_dir, "--host", "127.0.0.1", "--port", str(port),
                                  "--http-port", str(free_port()), "--drain-timeout", "60"],
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
