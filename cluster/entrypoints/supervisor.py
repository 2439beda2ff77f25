"""``serve --api-server-count N``: this process launches the replicas once (detached named actors), then runs N
gateway processes (``gateway.gateway_process_main``) that share the gRPC and HTTP ports through SO_REUSEPORT and
attach to those replicas. A gateway that dies is restarted (with backoff); SIGTERM or SIGINT drains every gateway,
then the replicas are shut down. Gateway ``i`` serves /metrics on ``--metrics-port + i``; gateway 0 alone exports
the replicas' own series, so that a sum over the gateways counts each once."""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

import ray

from pagedserve.cluster.entrypoints.gateway import GatewaySpec, gateway_process_main
from pagedserve.cluster.entrypoints.serve_options import ServeOptions
from pagedserve.cluster.runtime.private_ray import PrivateRay
from pagedserve.cluster.runtime.ray_auth import check_ray_auth
from pagedserve.cluster.runtime.replicas import launch_replicas, shutdown_replicas
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.executor.ray_utils import ensure_ray

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
STABLE_S = 60.0  # a gateway that ran this long before dying is restarted at once


@dataclass(eq=False)
class _GatewayProcess:
    index: int
    spec: GatewaySpec
    process: multiprocessing.Process | None = None
    started: float = 0.0
    failures: int = 0  # deaths in a row, each soon after its start
    restart_at: float | None = None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _check_metrics_ports(opts: ServeOptions) -> None:
    """Gateway ``i`` binds ``--metrics-port + i``: one that is taken would only fail and be restarted, over and over.
    Bound as the metrics server binds (address reuse on), so a port left in TIME_WAIT passes."""
    for i in range(opts.api_server_count if opts.metrics_port else 0):
        port = opts.metrics_port + i
        with socket.socket(socket.AF_INET6 if ":" in opts.host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((opts.host, port))
            except OSError as e:
                raise ValueError(f"gateway {i} of --api-server-count {opts.api_server_count} serves /metrics on "
                                 f"--metrics-port + {i} = {port}, which is taken on {opts.host}: {e.strerror}"
                                 ) from None


def supervise(args: EngineArgs, opts: ServeOptions, name: str, log_level: str = "INFO") -> int:
    _check_metrics_ports(opts)
    private_ray = None
    if not (args.ray_address or os.environ.get("RAY_ADDRESS")):
        private_ray = PrivateRay()
        private_ray.start()
    else:
        ensure_ray(args.ray_address)
        check_ray_auth(opts.allow_unauthenticated_ray)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after Ray's driver set its own (which exits at once)
        signal.signal(sig, lambda *_: stop.set())
    replicas, gateways = [], []
    try:
        replicas = launch_replicas(args, len(opts.replica_roles), opts.max_waiting_requests,
                                   opts.step_timeout or None, name, opts.replica_roles)
        if stop.is_set():
            logger.info("stopped while loading")
            return 0
        address = ray.get_runtime_context().gcs_address
        # Every gateway must bind the same ports, so a free one is chosen here.
        shared = dataclasses.replace(opts, served_model_name=name,
                                     grpc_port=opts.grpc_port or _free_port(opts.host))
        ctx = multiprocessing.get_context("spawn")
        for i in range(opts.api_server_count):
            metrics_port = opts.metrics_port + i if opts.metrics_port else 0
            spec = GatewaySpec(dataclasses.replace(shared, metrics_port=metrics_port), address,
                               args.tokenizer or args.model, reuse_port=True, engine_metrics=i == 0,
                               log_level=log_level)
            gateways.append(_GatewayProcess(i, spec))
        for g in gateways:
            _start(ctx, g)
        logger.info("%d gateways on %s:%d (gRPC)%s", len(gateways), opts.host, shared.grpc_port,
                    f" and HTTP port {opts.http_port}" if opts.http_port else "")
        while not stop.wait(0.2):
            for g in gateways:
                _watch(ctx, g)
        logger.info("draining %d gateway(s) (up to %.0f s)", len(gateways), opts.drain_timeout)
    finally:
        _stop_all(gateways, opts.drain_timeout + 15)
        shutdown_replicas(replicas)
        if private_ray is not None:
            private_ray.stop()
        logger.info("stopped")
    return 0


def _start(ctx, g: _GatewayProcess) -> None:
    g.process = ctx.Process(target=gateway_process_main, args=(g.spec,), name=f"pagedserve-gateway-{g.index}")
    g.process.start()
    g.started = time.monotonic()
    g.restart_at = None
    logger.info("gateway %d started (pid %d)", g.index, g.process.pid)


def _watch(ctx, g: _GatewayProcess) -> None:
    now = time.monotonic()
    if g.restart_at is not None:
        if now >= g.restart_at:
            _start(ctx, g)
        return
    if g.process.is_alive():
        return
    g.failures = 1 if now - g.started >= STABLE_S else g.failures + 1
    delay = min(MAX_BACKOFF_S, 0.5 * 2 ** (g.failures - 1))
    logger.error("gateway %d (pid %d) exited with %s; restarting it in %.1f s", g.index, g.process.pid,
                 g.process.exitcode, delay)
    g.restart_at = now + delay


def _stop_all(gateways: list[_GatewayProcess], timeout: float) -> None:
    """SIGTERM (each drains), then wait; a gateway still up past ``timeout`` is killed."""
    running = [g.process for g in gateways if g.process is not None and g.process.is_alive()]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + timeout
    for p in running:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            logger.warning("gateway pid %d did not stop in %.0f s; killing it", p.pid, timeout)
            p.kill()
            p.join(5)
