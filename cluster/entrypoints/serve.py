"""``pagedserve serve``: start (or join) Ray, launch the replicas, serve gRPC and HTTP (the OpenAI-compatible API)
until SIGTERM, then drain."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

import ray
import uvloop

from pagedserve.cluster.runtime.private_ray import PrivateRay
from pagedserve.cluster.runtime.replicas import Replica, launch_replicas, shutdown_replicas
from pagedserve.cluster.runtime.router import ReplicaRouter
from pagedserve.cluster.runtime.routing import DEFAULT_BALANCE_FACTOR, POLICIES, default_policy, make_policy
from pagedserve.cluster.server.gateway import Gateway
from pagedserve.cluster.server.metrics import GatewayMetrics
from pagedserve.cluster.server.state import ModelInfo
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.gc_heap import freeze_gc_heap
from pagedserve.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


DEFAULT_HTTP_PORT = 8000


@dataclass
class ServeOptions:
    """The server's own options (the engine's are ``EngineArgs``)."""

    host: str = "0.0.0.0"
    port: int = 50051
    api_key: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    data_parallel_size: int = 1
    max_waiting_requests: int | None = None
    max_concurrent_requests: int = 4096  # over all protocols; beyond it RESOURCE_EXHAUSTED / HTTP 429 at once
    step_timeout: float = 120.0  # an engine step making no progress this long restarts the engine; 0: never
    drain_timeout: float = 30.0
    served_model_name: str | None = None
    metrics_port: int = 9400  # 0: no /metrics endpoint
    # The OpenAI-compatible HTTP API; 0: none. `pagedserve serve --http-port` defaults to 8000; code that builds its
    # own options (the demo, tests) opts in.
    http_port: int = 0
    chat_template: str | None = None  # a file (or an inline template) overriding the tokenizer's chat template
    routing_policy: str | None = None  # None: prefix-aware with several replicas, else least-loaded
    routing_balance_factor: float = DEFAULT_BALANCE_FACTOR


async def serve(args: EngineArgs, opts: ServeOptions, stop: asyncio.Event | None = None,
                on_ready: Callable[[Gateway], None] | None = None) -> None:
    """Run until ``stop`` is set (by default on SIGTERM or SIGINT); ``on_ready`` gets the gateway once SERVING."""
    config = args.create_engine_config()  # fails fast on a bad model dir or TP split
    policy = make_policy(opts.routing_policy or default_policy(opts.data_parallel_size), opts.routing_balance_factor)
    model_dir = config.model_config.model
    tokenizer = load_tokenizer(args.tokenizer or model_dir)
    name = opts.served_model_name or os.path.basename(os.path.normpath(model_dir))
    metrics = GatewayMetrics(name)
    gateway = Gateway(tokenizer, metrics, opts.host, opts.port, opts.api_key, opts.ssl_certfile, opts.ssl_keyfile,
                      opts.max_concurrent_requests, opts.http_port or None, opts.chat_template)
    await gateway.start()
    if opts.metrics_port:
        gateway.metrics_port = metrics.start_http_server(opts.metrics_port, opts.host)
        logger.info("Prometheus metrics on http://%s:%d/metrics", opts.host, gateway.metrics_port)
    logger.info("gRPC gateway listening on %s:%d (NOT_SERVING until the model is loaded)", opts.host, gateway.port)
    if gateway.http is not None:
        logger.info("OpenAI-compatible API on %s://%s:%d/v1 (503 until the model is loaded)", gateway.http.scheme,
                    opts.host, gateway.http_port)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    # Without a cluster to join, Ray runs in a session of its own (see PrivateRay): a SIGTERM or Ctrl-C sent to this
    # process's group then leaves it up for the drain.
    private_ray = None
    if not ray.is_initialized() and not (args.ray_address or os.environ.get("RAY_ADDRESS")):
        private_ray = PrivateRay()
    replicas, engine = [], None

    def start_replicas() -> list[Replica]:
        if private_ray is not None:
            private_ray.start()
        return launch_replicas(args, opts.data_parallel_size, opts.max_waiting_requests, opts.step_timeout or None)

    try:
        launch = asyncio.ensure_future(asyncio.to_thread(start_replicas))
        await asyncio.wait([launch, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if not launch.done():
            logger.info("stopped while loading")
            replicas = await launch
            return
        replicas = launch.result()
        infos = await asyncio.gather(*[r.actor.get_info.remote() for r in replicas])
        engine = ReplicaRouter(replicas, tokenizer, infos, policy)
        engine.start()
        freeze_gc_heap()
        await gateway.set_ready(engine, ModelInfo(name, engine.info, len(replicas)))
        logger.info("ready: serving %s on %s:%d (%d replica(s), tensor_parallel_size=%d, %d KV blocks each)",
                    name, opts.host, gateway.port, len(replicas), engine.info.tensor_parallel_size,
                    engine.info.num_kv_blocks)
        if on_ready is not None:
            on_ready(gateway)
        await stop.wait()
        logger.info("draining (up to %.0f s)", opts.drain_timeout)
    finally:
        await gateway.drain(opts.drain_timeout if engine else 0.0)
        if engine is not None:
            await engine.close()
        shutdown_replicas(replicas)
        if private_ray is not None:
            private_ray.stop()
        logger.info("stopped")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    d = ServeOptions()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host)
    g.add_argument("--port", type=int, default=d.port, help="gRPC port")
    g.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="require 'authorization: Bearer KEY' (default: $PAGEDSERVE_API_KEY)")
    g.add_argument("--ssl-certfile", default=None)
    g.add_argument("--ssl-keyfile", default=None)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size,
                   help="model replicas (each its own TP group)")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="per replica; beyond it requests get RESOURCE_EXHAUSTED")
    g.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests,
                   help="generation requests in flight at once over all protocols; beyond it RESOURCE_EXHAUSTED "
                        "(HTTP 429) at once")
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                   help="seconds running requests get on SIGTERM")
    g.add_argument("--step-timeout", type=float, default=d.step_timeout,
                   help="seconds an engine step may make no progress before the engine is restarted (its requests "
                        "resume); 0: never")
    g.add_argument("--served-model-name", default=None, help="the model_name label and GetModelInfo name")
    g.add_argument("--metrics-port", type=int, default=d.metrics_port, help="Prometheus /metrics port (0: off)")
    g.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                   help="port of the OpenAI-compatible HTTP API (0: off); same key, TLS files and limits as gRPC")
    g.add_argument("--chat-template", default=None,
                   help="chat template file (Jinja) for /v1/chat/completions, overriding the tokenizer's")
    g.add_argument("--routing-policy", choices=POLICIES, default=None,
                   help="how requests pick a replica (default: prefix-aware with --data-parallel-size > 1, else "
                        "least-loaded)")
    g.add_argument("--routing-balance-factor", type=float, default=d.routing_balance_factor,
                   help="prefix-aware: a replica's score is its uncached prompt tokens plus this times its queued "
                        "and running work in tokens; higher spreads a hot prefix sooner, 0 routes by cache alone")


def add_arguments(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p)
    add_serve_args(p)


def run(ns: argparse.Namespace) -> int:
    opts = ServeOptions(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServeOptions)})
    # uvloop: the gateway's event loop wakes for every streamed token, and each wake costs less CPU than in asyncio's
    # own loop (CPU the engine shares on small hosts).
    uvloop.run(serve(EngineArgs.from_cli_args(ns), opts))
    return 0
