"""``pagedserve gateway``: a gateway process attached to the named replicas of a running cluster (those a ``pagedserve
serve`` launched): the same gRPC and HTTP servers as ``serve``'s, its own router and its own output stream from every
replica. ``serve --api-server-count N`` runs N of these on shared ports (SO_REUSEPORT)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

import ray
import uvloop

from pagedserve.cluster.runtime.ray_auth import ALLOW_FLAG, check_ray_auth
from pagedserve.cluster.runtime.replicas import NAMESPACE, Replica, attach_replicas, find_served_model
from pagedserve.cluster.runtime.router import ReplicaRouter
from pagedserve.cluster.runtime.routing import (
    DEFAULT_BALANCE_FACTOR,
    POLICIES,
    RoutingPolicy,
    default_policy,
    make_policy,
)
from pagedserve.cluster.server.api_options import ApiOptions, api_keys
from pagedserve.cluster.server.gateway import Gateway
from pagedserve.cluster.server.metrics import GatewayMetrics
from pagedserve.cluster.server.openai.tool_parsers import TOOL_PARSER_NAMES
from pagedserve.cluster.server.state import ModelInfo
from pagedserve.cluster.server.vllm_metrics import COMPAT_MODES
from pagedserve.engine.gc_heap import freeze_gc_heap
from pagedserve.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_HTTP_PORT = 8000  # as `vllm serve`: --port is the HTTP API's
DEFAULT_GRPC_PORT = 50051
ATTACH_POLL_S = 2.0
_PR_SET_PDEATHSIG = 1


@dataclass
class ServeOptions:
    """The server's own options (the engine's are ``EngineArgs``)."""

    host: str = "0.0.0.0"
    grpc_port: int = DEFAULT_GRPC_PORT
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
    # The OpenAI-compatible HTTP API; 0: none. `pagedserve serve --port` defaults to 8000; code that builds its own
    # options (the demo, tests) opts in.
    http_port: int = 0
    chat_template: str | None = None  # a file (or an inline template) overriding the tokenizer's chat template
    api_server_count: int = 1  # gateway processes sharing the ports; 1: the gateway runs in serve's own process
    # Launch the replicas as detached named actors that `pagedserve gateway` can attach to. `pagedserve serve` does;
    # code that builds its own options (the demo, tests, several servers of one model in one cluster) opts in.
    name_replicas: bool = False
    routing_policy: str | None = None  # None: prefix-aware with several replicas, else least-loaded
    routing_balance_factor: float = DEFAULT_BALANCE_FACTOR
    strict_request_fields: bool = False  # HTTP: unknown request fields are a 400 rather than ignored with a warning
    metrics_compat: str = "vllm"  # also export vLLM's names for the same series ("none": only pagedserve's)
    disable_fastapi_docs: bool = False
    enable_prompt_tokens_details: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    allow_unauthenticated_ray: bool = False  # join a Ray cluster reachable beyond loopback that has token auth off
    autoscale: str | None = None  # the autoscaling policy (AutoscalePolicy.parse); None: recommend only (metrics)

    def __post_init__(self) -> None:
        if self.routing_policy is not None and self.routing_policy not in POLICIES:
            raise ValueError(f"routing_policy must be one of {', '.join(POLICIES)}, got {self.routing_policy!r}")

    @property
    def api_options(self) -> ApiOptions:
        return ApiOptions(self.strict_request_fields, self.disable_fastapi_docs, self.enable_prompt_tokens_details,
                          self.enable_auto_tool_choice, self.tool_call_parser)

    def make_policy(self, num_replicas: int) -> RoutingPolicy:
        return make_policy(self.routing_policy or default_policy(num_replicas), self.routing_balance_factor)


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
    gateway = Gateway(tokenizer, metrics, opts.host, opts.grpc_port, opts.api_key, opts.ssl_certfile, opts.ssl_keyfile,
                      opts.max_concurrent_requests, opts.http_port or None, opts.chat_template, spec.reuse_port,
                      f"{socket.gethostname()}/{os.getpid()}", api_options=opts.api_options)
    engine, discovery = None, None
    try:
        if opts.metrics_port:  # first: a gateway that cannot bind its metrics port never takes a connection
            gateway.metrics_port = metrics.start_http_server(opts.metrics_port, opts.host)
        await gateway.start()
        engine = ReplicaRouter(replicas, tokenizer, infos, opts.make_policy(len(replicas)))
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


def add_server_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The flags of the gateway's servers (``serve`` and ``gateway`` share them)."""
    d = ServeOptions()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host)
    g.add_argument("--port", dest="http_port", type=int, default=DEFAULT_HTTP_PORT,
                   help="port of the OpenAI-compatible HTTP API (0: off); same key, TLS files and limits as gRPC")
    g.add_argument("--grpc-port", type=int, default=d.grpc_port, help="port of the gRPC API")
    g.add_argument("--api-key", action=_ApiKeys, default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="require 'authorization: Bearer KEY' with one of the keys given (repeat the flag, or a comma "
                        "list; default: $PAGEDSERVE_API_KEY)")
    g.add_argument("--api-key-file", action=_ApiKeys, dest="api_key", metavar="PATH",
                   help="the keys from a file, one per line (a mounted secret rather than the environment)")
    g.add_argument("--ssl-certfile", default=None)
    g.add_argument("--ssl-keyfile", default=None)
    g.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests,
                   help="generation requests in flight at once over all protocols; beyond it RESOURCE_EXHAUSTED "
                        "(HTTP 429) at once")
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                   help="seconds running requests get on SIGTERM")
    g.add_argument("--served-model-name", default=None, help="the model_name label and GetModelInfo name")
    g.add_argument("--metrics-port", type=int, default=d.metrics_port, help="Prometheus /metrics port (0: off)")
    g.add_argument("--metrics-compat", choices=COMPAT_MODES, default=d.metrics_compat,
                   help="vllm: also export the series vLLM's dashboards and autoscalers read (vllm:*), with vLLM's "
                        "names and labels; none: only pagedserve_*")
    g.add_argument("--chat-template", default=None,
                   help="chat template file (Jinja) for /v1/chat/completions, overriding the tokenizer's")
    g.add_argument("--strict-request-fields", action="store_true",
                   help="HTTP: refuse unknown request fields (400) instead of ignoring them with a warning, as vLLM")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report the prompt tokens served from the prefix cache in usage (HTTP "
                        "prompt_tokens_details.cached_tokens, gRPC cached_prompt_tokens); off: one tenant would see "
                        "what another has cached")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="serve no /docs, /redoc or /openapi.json on the HTTP port")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="chat: with tool_choice 'auto' (the default when tools are given), parse the model's text for "
                        "tool calls with --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSER_NAMES,
                   help="how the model writes tool calls (vLLM's names)")
    g.add_argument(ALLOW_FLAG, action="store_true",
                   help="serve from a Ray cluster reachable beyond loopback even though its token authentication is "
                        "off (refused by default)")
    g.add_argument("--routing-policy", choices=POLICIES, default=None,
                   help="how requests pick a replica (default: prefix-aware with more than one replica, else "
                        "least-loaded)")
    g.add_argument("--routing-balance-factor", type=float, default=d.routing_balance_factor,
                   help="prefix-aware: a replica's score is its uncached prompt tokens plus this times its queued "
                        "and running work in tokens; higher spreads a hot prefix sooner, 0 routes by cache alone")
    return g


class _ApiKeys(argparse.Action):
    """``--api-key KEY`` (repeatable, or a comma list) and ``--api-key-file PATH`` gather into one comma-separated
    ``api_key``; given any, they replace $PAGEDSERVE_API_KEY."""

    def __call__(self, parser, ns, value, option_string=None) -> None:
        if option_string == "--api-key-file":
            path = value
            try:
                with open(path) as f:
                    value = ",".join(line.strip() for line in f if line.strip())
            except OSError as e:
                parser.error(f"--api-key-file: {e}")
            if not value:
                parser.error(f"--api-key-file: no key in {path}")
        given = getattr(ns, "_api_keys_given", [])
        ns._api_keys_given = [*given, *api_keys(value)]
        setattr(ns, self.dest, ",".join(ns._api_keys_given) or None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS"),
                   help="the Ray cluster whose replicas to serve (default: $RAY_ADDRESS)")
    p.add_argument("--tokenizer", default=None, help="default: the model directory the replicas report")
    p.add_argument("--engine-metrics", action="store_true",
                   help="also export the replicas' series on /metrics (off: the serve process exports them)")
    p.add_argument("--reuse-port", action="store_true",
                   help="share the ports with other gateway processes on this host (SO_REUSEPORT)")
    add_server_args(p)


def run(ns: argparse.Namespace) -> int:
    if not ns.ray_address:
        raise ValueError("--ray-address (or $RAY_ADDRESS) is required: the cluster whose replicas to serve")
    fields = {f.name for f in dataclasses.fields(ServeOptions)}
    opts = ServeOptions(**{k: v for k, v in vars(ns).items() if k in fields})
    spec = GatewaySpec(opts, ns.ray_address, ns.tokenizer, ns.reuse_port, ns.engine_metrics,
                       logging.getLevelName(logging.getLogger().level))
    uvloop.run(run_gateway(spec))
    _exit_now()
    return 0
