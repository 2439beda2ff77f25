"""``pagedserve serve``: start (or join) Ray, launch the replicas, serve gRPC and HTTP (the OpenAI-compatible API)
until SIGTERM, then drain. With ``--api-server-count N`` > 1 this process supervises N gateway processes sharing the
ports (see ``supervisor``) instead of serving itself."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Callable

import ray
import uvloop

from pagedserve.cluster.entrypoints.serve_options import ServeOptions
from pagedserve.cluster.entrypoints.supervisor import supervise
from pagedserve.cluster.runtime.autoscaler import AutoscalePolicy, Autoscaler
from pagedserve.cluster.runtime.autoscaler import collect_metrics as autoscaler_metrics
from pagedserve.cluster.runtime.private_ray import PrivateRay
from pagedserve.cluster.runtime.ray_auth import check_ray_auth
from pagedserve.cluster.runtime.replica_set import ReplicaSet
from pagedserve.cluster.runtime.replicas import Replica, launch_replicas, shutdown_replicas
from pagedserve.cluster.runtime.router import ReplicaRouter
from pagedserve.cluster.server.gateway import Gateway
from pagedserve.cluster.server.metrics import GatewayMetrics
from pagedserve.cluster.server.state import ModelInfo
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.executor.ray_utils import ensure_ray
from pagedserve.engine.gc_heap import freeze_gc_heap
from pagedserve.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


async def serve(args: EngineArgs, opts: ServeOptions, stop: asyncio.Event | None = None,
                on_ready: Callable[[Gateway], None] | None = None) -> None:
    """Run until ``stop`` is set (by default on SIGTERM or SIGINT); ``on_ready`` gets the gateway once SERVING."""
    config = args.create_engine_config()  # fails fast on a bad model dir or TP split
    model_dir = config.model_config.model
    tokenizer = load_tokenizer(args.tokenizer or model_dir)
    name = served_model_name(opts, model_dir)
    metrics = GatewayMetrics(name, compat=opts.metrics_compat)
    gateway = Gateway(tokenizer, metrics, opts.host, opts.grpc_port, opts.keys, opts.ssl_certfile, opts.ssl_keyfile,
                      opts.max_concurrent_requests, opts.http_port or None, opts.chat_template,
                      api_options=opts.api_options, tenancy=opts.tenancy)
    await gateway.start()
    if opts.metrics_port:
        gateway.metrics_port = metrics.start_http_server(opts.metrics_port, opts.host)
        logger.info("Prometheus metrics on http://%s:%d/metrics", opts.host, gateway.metrics_port)
    logger.info("gRPC API listening on %s:%d (NOT_SERVING until the model is loaded)", opts.host, gateway.port)
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
    policy = AutoscalePolicy.parse(opts.autoscale) if opts.autoscale else AutoscalePolicy()
    replicas, engine, replica_set, autoscalers = [], None, None, []

    def start_replicas() -> list[Replica]:
        if private_ray is not None:
            private_ray.start()
        else:
            ensure_ray(args.ray_address)
            check_ray_auth(opts.allow_unauthenticated_ray)
        return launch_replicas(args, len(opts.replica_roles), opts.max_waiting_requests, opts.step_timeout or None,
                               name if opts.name_replicas else None, opts.replica_roles)

    try:
        launch = asyncio.ensure_future(asyncio.to_thread(start_replicas))
        await asyncio.wait([launch, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if not launch.done():
            logger.info("stopped while loading")
            replicas = await launch
            return
        replicas = launch.result()
        infos = await asyncio.gather(*[r.actor.get_info.remote() for r in replicas])
        engine = ReplicaRouter(replicas, tokenizer, infos, opts.make_policy(len(replicas)), opts.disagg)
        engine.start()
        replica_set = ReplicaSet(args, replicas, engine, opts.drain_timeout, opts.max_waiting_requests,
                                 opts.step_timeout or None, name if opts.name_replicas else None)
        pools = ["prefill", "decode"] if opts.prefill_replicas else [None]  # each pool on its own signals
        autoscalers = [Autoscaler(policy, engine, replica_set, opts.autoscale is not None, pool) for pool in pools]
        engine.metric_sources.append(lambda: autoscaler_metrics(autoscalers))
        for autoscaler in autoscalers:
            autoscaler.start()
        freeze_gc_heap()
        await gateway.set_ready(engine, ModelInfo(name, engine.info, len(replicas)), replica_set)
        logger.info("ready: serving %s on %s:%d (%d replica(s), tensor_parallel_size=%d, %d KV blocks each)",
                    name, opts.host, gateway.port, len(replicas), engine.info.tensor_parallel_size,
                    engine.info.num_kv_blocks)
        if on_ready is not None:
            on_ready(gateway)
        await stop.wait()
        logger.info("draining (up to %.0f s)", opts.drain_timeout)
    finally:
        for autoscaler in autoscalers:
            await autoscaler.stop()
        await gateway.drain(opts.drain_timeout if engine else 0.0)
        if engine is not None:
            await engine.close()
        if replica_set is not None:
            await replica_set.shutdown()  # after a scaling operation in progress ends
        else:
            shutdown_replicas(replicas)
        if private_ray is not None:
            private_ray.stop()
        logger.info("stopped")


def served_model_name(opts: ServeOptions, model_dir: str) -> str:
    return opts.served_model_name or os.path.basename(os.path.normpath(model_dir))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model dir (as --model)")
    EngineArgs.add_cli_args(p)
    ServeOptions.add_cli_args(p, serve=True)


def run(ns: argparse.Namespace) -> int:
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise ValueError(f"two models given: {ns.model_tag!r} and --model {ns.model!r}")
        ns.model = ns.model_tag
    opts = ServeOptions.from_cli_args(ns, name_replicas=True)
    if opts.api_server_count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {opts.api_server_count}")
    if opts.autoscale is not None:
        AutoscalePolicy.parse(opts.autoscale)  # a bad policy fails before anything starts
        if opts.api_server_count > 1:
            raise ValueError("--autoscale needs the replicas and the gateway in one process (--api-server-count 1)")
    if opts.api_server_count > 1:
        args = EngineArgs.from_cli_args(ns)
        return supervise(args, opts, served_model_name(opts, args.create_engine_config().model_config.model),
                         logging.getLevelName(logging.getLogger().level))
    # uvloop: the gateway's event loop wakes for every streamed token, and each wake costs less CPU than in asyncio's
    # own loop (CPU the engine shares on small hosts).
    uvloop.run(serve(EngineArgs.from_cli_args(ns), opts))
    return 0
