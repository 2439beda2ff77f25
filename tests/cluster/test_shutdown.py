"""`pagedserve serve` as a real process with its own private Ray, stopped by a real signal: SIGTERM to the process
alone, SIGTERM to its whole process group (a supervisor, `kill -TERM -PGID`), and Ctrl-C (SIGINT to the group). In
each case health turns NOT_SERVING, a new request gets UNAVAILABLE, the running stream finishes with all its tokens,
the server exits 0 within the drain timeout, and not one of its processes (Ray's included) is left."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.cluster.client import Client
from pagedserve.tests.server_thread import free_port

DRAIN_TIMEOUT = 60


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


CASES = [("process", signal.SIGTERM), ("group", signal.SIGTERM), ("group", signal.SIGINT)]


class Served:
    """A `serve` process, its gRPC port, and its stderr as read so far (read on a thread: the pipe never fills)."""

    def __init__(self, llama_dir: str) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a private Ray, as a plain `serve` has
        # Its own session and process group, as a terminal or a supervisor gives a service; the test is not in it.
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedserve", "serve", "--model", llama_dir, "--host",
                                      "127.0.0.1", "--grpc-port", str(self.port), "--port", str(free_port()),
                                      "--metrics-port", "0", "--drain-timeout", str(DRAIN_TIMEOUT)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.log: list[str] = []
        self._reader = threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True)
        self._reader.start()

    def stderr_tail(self) -> str:
        return "".join(self.log)[-3000:]


@pytest.fixture(scope="module")
def served(llama_dir):
    """One `serve` process per case, all started together with the module (starting is mostly imports and Ray's
    own start-up); each test signals its own. One a test did not reach (`-k`) is stopped with its group at the end."""
    procs = {case: Served(llama_dir) for case in CASES}
    yield procs
    for s in procs.values():
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGTERM)
            try:
                s.proc.wait(DRAIN_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(s.proc.pid, signal.SIGKILL)
                s.proc.wait(10)


@pytest.mark.parametrize("target, sig", CASES)
def test_signal_drains_and_leaves_nothing(served, target, sig):
    server = served[(target, sig)]
    proc, port = server.proc, server.port
    target_addr = f"127.0.0.1:{port}"
    descendants: list[psutil.Process] = []
    try:
        with Client(target_addr, timeout=5) as c:
            c.wait_for_health("SERVING", 180, check=lambda: _alive(server))
            descendants = _descendants(proc.pid)
            assert any("ray" in " ".join(p.cmdline()) for p in descendants), "no private Ray under the server"
            engines = [p for p in descendants if "EngineCoreActor" in p.name() + " ".join(p.cmdline())]
            assert engines and all(p.nice() == 0 for p in engines)  # not Ray's default 15 for workers
            stream = c.stream("class", max_tokens=150, temperature=0.0, ignore_eos=True)
            tokens = [len(next(stream).completions[0].token_ids)]
            rest = threading.Thread(target=lambda: tokens.extend(len(r.completions[0].token_ids) for r in stream))
            rest.start()
            # Watch, not polling: the server pushes NOT_SERVING when it starts to drain, and a short drain on a fast
            # host can end (and the process exit) between two polls.
            watch = health_pb2_grpc.HealthStub(c.channel).Watch(health_pb2.HealthCheckRequest(service=""),
                                                                  timeout=DRAIN_TIMEOUT)
            assert _status(next(watch)) == "SERVING"
            sent = time.monotonic()
            if target == "group":
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
            assert _status(next(watch)) == "NOT_SERVING", server.stderr_tail()
            with pytest.raises(grpc.RpcError) as err:
                c.generate("def", max_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            rest.join(DRAIN_TIMEOUT)
        assert sum(tokens) == 150  # the running stream finished during the drain
        assert proc.wait(DRAIN_TIMEOUT) == 0, server.stderr_tail()
        assert time.monotonic() - sent < DRAIN_TIMEOUT
        _, alive = psutil.wait_procs(descendants, timeout=15)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in descendants:
            if p.is_running():
                p.kill()


def _alive(server: Served) -> None:
    assert server.proc.poll() is None, server.stderr_tail()


def _status(resp: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
