"""``pagedserve gateway``: a gateway process attached to the named replicas of a running cluster (those a ``pagedserve
serve`` launched): the same gRPC and HTTP servers as ``serve``'s, its own router and its own output stream from every
replica. ``serve --api-server-count N`` runs N of these on shared ports (SO_REUSEPORT)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

import ray
import uvloop

from pagedserve.cluster.entrypoints.serve_options import ServeOptions
from pagedserve.cluster.runtime.ray_auth import check_ray_auth
from pagedserve.cluster.runtime.replicas import NAMESPACE, Replica, attach_replicas, find_served_model
from pagedserve.cluster.runtime.router import ReplicaRouter
from pagedserve.cluster.server.gateway import Gateway
from pagedserve.cluster.server.metrics import GatewayMetrics
from pagedserve.cluster.server.state import ModelInfo
from pagedserve.engine.gc_heap import freeze_gc_heap
from pagedserve.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

ATTACH_POLL_S = 2.0
_PR_SET_PDEATHSIG = 1


@dataclass
class GatewaySpec:
    """One attached gateway (picklable: ``serve --api-server-count`` hands it to each gateway process it spawns)."""

    opts: ServeOptions
    ray_address: str
    tokenizer: str | None = None  # default: the model directory the replicas report
    reuse_port: bool = False
    # Export the replicas' own series on /metrics: exactly one gateway per cluster should, so none is counted twice.
    engine_metrics: bool = True
    log_level: str = "INFO"


async def run_gateway(spec: GatewaySpec, stop: asyncio.Event | None = None,
                      on_ready: Callable[[Gateway], None] | None = None) -> None:
    """Attach to the replicas (waiting for them to appear), serve until ``stop`` (default: SIGTERM or SIGINT), drain.
    The replicas are left running: their launcher owns them."""
    opts = spec.opts
    if not ray.is_initialized():  # first: ray.init installs a SIGTERM handler of its own, which ours replaces
        ray.init(address=spec.ray_address, namespace=NAMESPACE, log_to_driver=False)
    check_ray_auth(opts.allow_unauthenticated_ray)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    found = asyncio.ensure_future(_wait_for_replicas(opts.served_model_name))
    await asyncio.wait([found, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if not found.done():
        found.cancel()
        return
    name, replicas = found.result()
    infos = await asyncio.gather(*[r.actor.get_info.remote() for r in replicas])
    tokenizer = load_tokenizer(spec.tokenizer or infos[0].model)
    metrics = GatewayMetrics(name, spec.engine_metrics, opts.metrics_compat)
    gateway = Gateway(tokenizer, metrics, opts.host, opts.grpc_port, opts.keys, opts.ssl_certfile, opts.ssl_keyfile,
                      opts.max_concurrent_requests, opts.http_port or None, opts.chat_template, spec.reuse_port,
                      f"{socket.gethostname()}/{os.getpid()}", api_options=opts.api_options, tenancy=opts.tenancy)
    engine, discovery = None, None
    try:
        if opts.metrics_port:  # first: a gateway that cannot bind its metrics port never takes a connection
            gateway.metrics_port = metrics.start_http_server(opts.metrics_port, opts.host)
        await gateway.start()
        engine = ReplicaRouter(replicas, tokenizer, infos, opts.make_policy(len(replicas)), opts.disagg)
        engine.start()
        discovery = asyncio.ensure_future(_follow_replicas(name, engine))
        freeze_gc_heap()
        await gateway.set_ready(engine, ModelInfo(name, engine.info, len(replicas)))
        logger.info("gateway %s ready: serving %s on %s:%d (gRPC), HTTP port %s, metrics port %s (%d replica(s))",
                    gateway.gateway_id, name, opts.host, gateway.port, gateway.http_port, gateway.metrics_port,
                    len(replicas))
        if on_ready is not None:
            on_ready(gateway)
        await stop.wait()
        logger.info("gateway %s draining (up to %.0f s)", gateway.gateway_id, opts.drain_timeout)
    finally:
        if discovery is not None:
            discovery.cancel()
        await gateway.drain(opts.drain_timeout if engine else 0.0)
        if engine is not None:
            await engine.close()
        logger.info("gateway %s stopped", gateway.gateway_id)


async def _follow_replicas(name: str, router: ReplicaRouter) -> None:
    """Route to the replicas a scale-out or rollout adds (their launcher owns them; one it removes tells the
    gateways itself, by draining)."""
    while True:
        await asyncio.sleep(ATTACH_POLL_S)
        try:
            found = await asyncio.to_thread(attach_replicas, name)
        except Exception as e:  # the GCS briefly unreachable: the next poll tries again
            logger.warning("listing the replicas of %s failed: %s", name, e)
            continue
        known = {r.index for r in router.replicas}
        for replica in found:
            if replica.index not in known:
                with contextlib.suppress(ray.exceptions.RayError):  # gone again before it was reached
                    await replica.actor.warmup.remote()  # a no-op once its launcher warmed it up
                    await router.add_replica(replica)


async def _wait_for_replicas(model_name: str | None) -> tuple[str, list[Replica]]:
    waited = 0.0
    while True:
        name = await asyncio.to_thread(find_served_model, model_name)
        replicas = await asyncio.to_thread(attach_replicas, name) if name is not None else []
        if replicas:
            return name, replicas
        if waited % 30 < ATTACH_POLL_S:
            logger.info("waiting for the replicas of %s to appear in Ray namespace %r", model_name or "a model",
                        NAMESPACE)
        await asyncio.sleep(ATTACH_POLL_S)
        waited += ATTACH_POLL_S


def gateway_process_main(spec: GatewaySpec) -> None:
    """A spawned gateway process: ends when its supervisor dies (SIGTERM from the kernel, then a drain)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    logging.basicConfig(level=spec.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvloop.run(run_gateway(spec))
    _exit_now()


def _exit_now() -> None:
    """Drained and closed: skip the interpreter's teardown, where Ray's and gRPC's threads can crash the process."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS"),
                   help="the Ray cluster whose replicas to serve (default: $RAY_ADDRESS)")
    p.add_argument("--tokenizer", default=None, help="default: the model directory the replicas report")
    p.add_argument("--engine-metrics", action="store_true",
                   help="also export the replicas' series on /metrics (off: the serve process exports them)")
    p.add_argument("--reuse-port", action="store_true",
                   help="share the ports with other gateway processes on this host (SO_REUSEPORT)")
    ServeOptions.add_cli_args(p, serve=False)


def run(ns: argparse.Namespace) -> int:
    if not ns.ray_address:
        raise ValueError("--ray-address (or $RAY_ADDRESS) is required: the cluster whose replicas to serve")
    spec = GatewaySpec(ServeOptions.from_cli_args(ns), ns.ray_address, ns.tokenizer, ns.reuse_port, ns.engine_metrics,
                       logging.getLevelName(logging.getLogger().level))
    uvloop.run(run_gateway(spec))
    _exit_now()
    return 0
