"""Test harness: a gateway run by ``serve()`` on its own event loop in a background thread."""
from __future__ import annotations

import abc
import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import psutil
import uvloop
from ray._private.node import Node
from ray.cluster_utils import Cluster

from pagedserve.cluster.client import Client
from pagedserve.cluster.entrypoints.gateway import GatewaySpec, run_gateway
from pagedserve.cluster.entrypoints.serve import serve
from pagedserve.cluster.entrypoints.serve_options import ServeOptions
from pagedserve.engine.arg_utils import EngineArgs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports_in_a_row(n: int) -> int:
    """The first of ``n`` consecutive ports free now (``--metrics-port`` of ``--api-server-count n``), below the
    kernel's range of local ports for outgoing connections: there, any connection made meanwhile can take one."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    for _ in range(100):
        first = random.randrange(10000, max(ephemeral, 20000) - n)
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + n):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    raise RuntimeError(f"no {n} free ports in a row")


def kill_ray_head(head: subprocess.Popen, temp_dir: str) -> None:
    """Stop a `ray start --head --block` started in a session of its own, with every process under it, and remove
    its temp dir. Killed outright: a graceful stop of a Ray head took 10 to 30 s here, and the test is done with it."""
    with contextlib.suppress(psutil.NoSuchProcess):
        procs = psutil.Process(head.pid).children(recursive=True)
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(10)
        _kill(procs)
    shutil.rmtree(temp_dir, ignore_errors=True)


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


def add_node(cluster: Cluster, **node_args) -> Node:
    """``cluster.add_node`` (a ``ray.cluster_utils.Cluster``), tried once more where the node did not register within
    Ray's 30 s start-up wait. That happened in one of twelve runs of the lost-node test on a 2-core VM, right after a
    node was removed; Ray's own tests meet it too. What the failed try started (this process's new children, with
    theirs) is killed first, so that no stray raylet outlives the test."""
    before = {p.pid for p in psutil.Process().children()}
    try:
        return cluster.add_node(**node_args)
    except Exception as e:
        if "timed out during startup" not in str(e):
            raise
        started = [p for p in psutil.Process().children() if p.pid not in before]
        strays = list(started)
        for p in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                strays += p.children(recursive=True)
        _kill(strays)
        print(f"add_node: {e}; killed {len(strays)} processes it left, trying once more", file=sys.stderr)
        return cluster.add_node(**node_args)


class _LoopThread(abc.ABC):
    """Runs ``_main(stop)`` on its own uvloop event loop (as the CLI runs it) in a background thread; ``stop``
    ends it. An error it raised surfaces from ``_check`` and ``_end``. ``_settled`` is set once it ended, or earlier
    by a subclass once what it runs is ready."""

    def __init__(self) -> None:
        self._loop = uvloop.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._settled = threading.Event()

    @abc.abstractmethod
    async def _main(self, stop: asyncio.Event) -> None:
        """What the thread runs until ``stop`` is set."""

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()
        try:
            self._loop.run_until_complete(self._main(self._stop))
        except BaseException as e:
            self._error = e
        finally:
            self._settled.set()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _end(self, timeout: float) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        self._check()


class ServerThread(_LoopThread):
    def __init__(self, args: EngineArgs, **opts) -> None:
        super().__init__()
        opts.setdefault("grpc_port", free_port())
        opts.setdefault("metrics_port", 0)
        opts.setdefault("http_port", 0)  # no HTTP API unless asked (http_port=free_port())
        self.opts = ServeOptions(host="127.0.0.1", **opts)
        self.target = f"127.0.0.1:{self.opts.grpc_port}"
        scheme = "https" if self.opts.ssl_certfile else "http"
        self.http_url = f"{scheme}://127.0.0.1:{self.opts.http_port}" if self.opts.http_port else None
        self.args = args
        self.health_seen: list[str] = []  # distinct health states, in the order first seen
        self.gateway = None  # the running Gateway, once SERVING

    async def _main(self, stop: asyncio.Event) -> None:
        await serve(self.args, self.opts, stop, self._ready)

    def _ready(self, gateway) -> None:
        self.gateway = gateway

    @property
    def replicas(self):
        return list(self.gateway.state.engine.replicas)

    def client(self, **kw) -> Client:
        return Client(self.target, **kw)

    def start(self, timeout: float = 120.0, **client_kw) -> ServerThread:
        self._thread.start()
        with self.client(timeout=2, **client_kw) as c:
            self.health_seen = c.wait_for_health("SERVING", timeout, check=self._check)
        return self

    def stop(self) -> None:
        self._end(120)


class GatewayThread(_LoopThread):
    """One more gateway attached to a running server's named replicas (as ``pagedserve gateway``), on its own event
    loop in a background thread of this process (whose Ray connection it uses); a context manager."""

    def __init__(self, model_name: str, **opts) -> None:
        super().__init__()
        opts.setdefault("grpc_port", free_port())
        opts.setdefault("http_port", free_port())
        opts.setdefault("metrics_port", 0)
        self.spec = GatewaySpec(ServeOptions(host="127.0.0.1", served_model_name=model_name, **opts), ray_address="",
                                engine_metrics=False)
        self.http_url = f"http://127.0.0.1:{self.spec.opts.http_port}"
        self.gateway = None  # the running Gateway, once ready

    async def _main(self, stop: asyncio.Event) -> None:
        await run_gateway(self.spec, stop, self._on_ready)

    def _on_ready(self, gateway) -> None:
        self.gateway = gateway
        self._settled.set()

    def __enter__(self) -> GatewayThread:
        self._thread.start()
        assert self._settled.wait(120), "the gateway did not attach in 120 s"
        self._check()
        return self

    def __exit__(self, *exc) -> None:
        self._end(60)


class HealthWatch:
    """Polls health in the background; ``seen`` holds the distinct states in order."""

    def __init__(self, srv: ServerThread) -> None:
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(srv,))

    def _run(self, srv: ServerThread) -> None:
        with srv.client(timeout=2) as c:
            while not self._stop.is_set():
                status = c.health()
                if not self.seen or self.seen[-1] != status:
                    self.seen.append(status)
                time.sleep(0.02)

    def start(self) -> HealthWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> HealthWatch:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_in_background(target: Callable[[], None], until: Callable[[], bool],
                        timeout: float = 60.0) -> threading.Thread:
    """Run ``target`` on a daemon thread and return once ``until()`` holds (a stream has started, say)."""
    t = threading.Thread(target=target, daemon=True)
    t.start()
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline and t.is_alive(), "the background work did not start"
        time.sleep(0.01)
    return t
