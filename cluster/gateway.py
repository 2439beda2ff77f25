"""The gRPC gateway (``pagedserve serve``): tokenizes, forwards requests to the scheduler actors and streams the
text back. Health (``grpc.health.v1``) and server reflection are served alongside."""
from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from pagedserve.cluster.engine_client import EngineClient, EngineUnavailableError
from pagedserve.cluster.metrics import GatewayMetrics
from pagedserve.cluster.protocol import FINISH_NAMES, ResponseBuilder, params_from_proto
from pagedserve.cluster.scheduler_actor import QueueFullError
from pagedserve.proto.v1 import generation_pb2 as pb
from pagedserve.proto.v1 import generation_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a 128k-token prompt as ids is ~0.6 MB; logprobs responses can be large
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Ping idle connections so dead clients (and their streams) are noticed within ~40 s.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]


@dataclass
class ModelInfo:
    name: str
    info: dict  # from the scheduler actor
    data_parallel_size: int


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, tokenizer, metrics: GatewayMetrics) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.engine: EngineClient | None = None  # set once the replicas are up
        self.model: ModelInfo | None = None
        self.draining = False
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def _ready_engine(self) -> EngineClient:
        if self.draining:
            raise EngineUnavailableError("the server is shutting down")
        if self.engine is None:
            raise EngineUnavailableError("the model is still loading")
        return self.engine

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.in_flight += 1
        self.idle.clear()
        timer = self.metrics.request()
        admitted = finished = False
        code = None
        try:
            engine = self._ready_engine()
            parsed = params_from_proto(request)
            ids = parsed.prompt_token_ids
            if ids is None:
                ids = self.tokenizer.encode(parsed.prompt) if parsed.prompt else []
            rid = request.request_id or uuid.uuid4().hex
            lp = getattr(parsed.params, "logprobs", None) or 0
            plp = getattr(parsed.params, "prompt_logprobs", None) or 0
            builder = ResponseBuilder(rid, len(ids), lp, plp)
            async for out in engine.generate(rid, parsed.prompt, ids, parsed.params, parsed.stream,
                                             request.cache_salt or None):
                if not admitted:
                    admitted = True
                    timer.admitted(len(ids))
                resp = builder.build(out)
                timer.tokens(sum(len(c.token_ids) for c in resp.completions))
                if out.finished:
                    finished = True
                    timer.finished(_finish_reason(resp))
                yield resp
        except (ValueError, TypeError) as e:
            code = grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(e))
        except QueueFullError as e:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            await context.abort(code, str(e))
        except EngineUnavailableError as e:
            code = grpc.StatusCode.UNAVAILABLE
            await context.abort(code, str(e))
        except Exception as e:  # a bug: say what, not a traceback
            logger.exception("Generate failed")
            code = grpc.StatusCode.INTERNAL
            await context.abort(code, f"internal error: {type(e).__name__}: {e}")
        finally:
            if code is not None:
                timer.error(code.name)
            if admitted and not finished:  # cancelled or deadline (abort), or failed (error)
                timer.finished("error" if code is not None else "abort")
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        ids = self.tokenizer.encode(request.text) if request.text else []
        return pb.TokenizeResponse(token_ids=ids, tokens=self.tokenizer.convert_ids_to_tokens(ids))

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        vocab = len(self.tokenizer)
        bad = [t for t in request.token_ids if t >= vocab]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token_ids: {bad[:5]} outside the vocabulary [0, {vocab})")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(text=self.tokenizer.decode(list(request.token_ids), skip_special_tokens=skip))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        try:
            engine = self._ready_engine()
        except EngineUnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        m = self.model
        stats = await engine.stats()
        total = sum(s["kv_blocks_total"] for s in stats)
        free = sum(s["kv_blocks_free"] for s in stats)
        return pb.GetModelInfoResponse(
            model_name=m.name, architecture=m.info["architecture"], max_model_len=m.info["max_model_len"],
            vocab_size=m.info["vocab_size"], tensor_parallel_size=m.info["tensor_parallel_size"],
            data_parallel_size=m.data_parallel_size, block_size=m.info["block_size"],
            num_kv_blocks=m.info["num_kv_blocks"], num_free_kv_blocks=free,
            kv_cache_usage=1.0 - free / total if total else 0.0,
            num_running_requests=sum(s["num_running"] for s in stats),
            num_waiting_requests=sum(s["num_waiting"] for s in stats),
            eos_token_ids=m.info["eos_token_ids"], dtype=m.info["dtype"])

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        found = self.engine is not None and await self.engine.abort(request.request_id)
        return pb.AbortResponse(found=found)


def _finish_reason(resp: pb.GenerateResponse) -> str:
    reasons = [FINISH_NAMES[c.finish_reason] for c in resp.completions if c.finish_reason]
    return reasons[0] if reasons else "stop"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer KEY`` (or ``x-api-key: KEY``) on every call but health checks,
    which load balancers and Kubernetes probes make without credentials."""

    def __init__(self, api_key: str, metrics: GatewayMetrics | None = None) -> None:
        self.expected = [f"Bearer {api_key}".encode(), api_key.encode()]
        self.metrics = metrics

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        md = dict(details.invocation_metadata or ())
        given = [md.get("authorization", ""), md.get("x-api-key", "")]
        if any(hmac.compare_digest(g.encode(), e) for g, e in zip(given, self.expected) if g):
            return handler
        if self.metrics is not None and details.method.endswith("/Generate"):
            self.metrics.request().error("UNAUTHENTICATED")
        return _deny(handler)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    msg = "missing or wrong API key: send metadata 'authorization: Bearer <key>'"

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)
        yield  # pragma: no cover - makes this an async generator

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.stream_stream_rpc_method_handler(stream, **kw)


class Gateway:
    """The gRPC server: up (NOT_SERVING) before the model loads, SERVING after warm-up, NOT_SERVING while draining."""

    def __init__(self, tokenizer, metrics: GatewayMetrics, host: str = "0.0.0.0", port: int = 50051,
                 api_key: str | None = None, ssl_certfile: str | None = None, ssl_keyfile: str | None = None) -> None:
        interceptors = [ApiKeyInterceptor(api_key, metrics)] if api_key else []
        self.server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
        self.metrics = metrics
        self.metrics_port: int | None = None
        self.servicer = GenerationServicer(tokenizer, metrics)
        pb_grpc.add_GenerationServiceServicer_to_server(self.servicer, self.server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server)
        address = f"{host}:{port}"
        if ssl_certfile or ssl_keyfile:
            if not (ssl_certfile and ssl_keyfile):
                raise ValueError("TLS needs both --ssl-certfile and --ssl-keyfile")
            with open(ssl_keyfile, "rb") as k, open(ssl_certfile, "rb") as c:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            self.port = self.server.add_secure_port(address, creds)
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")

    async def start(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def set_ready(self, engine: EngineClient, model: ModelInfo) -> None:
        self.servicer.engine, self.servicer.model = engine, model
        self.metrics.replicas.engine = engine
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, let the running ones finish (up to ``timeout`` s), then stop."""
        self.servicer.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            await asyncio.wait_for(self.servicer.idle.wait(), timeout)
        except asyncio.TimeoutError:
            logger.warning("drain timeout: %d request(s) still running are cancelled", self.servicer.in_flight)
        await self.server.stop(grace=1.0)
        self.metrics.stop_http_server()
