"""The gRPC server (``pagedserve serve``): the generation service, health (``grpc.health.v1``) and server
reflection, an optional API key and TLS, and a drain on shutdown."""
from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from pagedserve.cluster.server.auth import ApiKeyInterceptor
from pagedserve.cluster.server.metrics import GatewayMetrics
from pagedserve.cluster.server.servicer import GenerationServicer, ModelInfo
from pagedserve.engine.protocol import EngineClient
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
        self.metrics.engines.engine = engine
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
