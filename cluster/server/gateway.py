"""The gateway (``pagedserve serve``'s front door): one serving state shared by every protocol's server (gRPC, and
the OpenAI-compatible HTTP API on the same event loop). Up, and NOT_SERVING, before the model loads; SERVING after
warm-up; NOT_SERVING while it drains on shutdown."""
from __future__ import annotations

import asyncio
import logging

from pagedserve.cluster.server.api_keys import KeyTable
from pagedserve.cluster.server.api_options import ApiOptions, exposure_warning
from pagedserve.cluster.server.grpc_api.server import GrpcServer
from pagedserve.cluster.server.metrics import GatewayMetrics
from pagedserve.cluster.server.openai.server import HttpServer
from pagedserve.cluster.server.state import ModelInfo, ServingState
from pagedserve.cluster.server.tenants import TenancyOptions
from pagedserve.engine.protocol import EngineClient, ReplicaScaler

logger = logging.getLogger(__name__)


class Gateway:
    def __init__(self, tokenizer, metrics: GatewayMetrics, host: str = "0.0.0.0", port: int = 50051,
                 keys: KeyTable = KeyTable(), ssl_certfile: str | None = None, ssl_keyfile: str | None = None,
                 max_concurrent_requests: int = 4096, http_port: int | None = None,
                 chat_template: str | None = None, reuse_port: bool = False, gateway_id: str | None = None,
                 api_options: ApiOptions = ApiOptions(), tenancy: TenancyOptions = TenancyOptions()) -> None:
        """``keys``: the API keys both protocols accept (none: no key needed) and the tenants they name;
        ``tenancy``: the tenants and their limits. ``http_port``: None serves no HTTP API (0: a free port).
        ``reuse_port``: share the ports with other gateway processes (SO_REUSEPORT); ``gateway_id``: names this one
        in HTTP responses' x-pagedserve-gateway header."""
        if max_concurrent_requests < 1:
            raise ValueError(f"max_concurrent_requests must be at least 1, got {max_concurrent_requests}")
        if (warning := exposure_warning(host, keys)) is not None:
            logger.warning(warning)
        self.metrics = metrics
        self.metrics_port: int | None = None
        self.state = ServingState(tokenizer, metrics, max_concurrent_requests, api_options, keys, tenancy)
        self.gateway_id = gateway_id
        self.grpc = GrpcServer(self.state, host, port, ssl_certfile, ssl_keyfile, reuse_port)
        self.port = self.grpc.port
        self.http = None
        if http_port is not None:
            self.http = HttpServer(self.state, host, http_port, ssl_certfile, ssl_keyfile, chat_template,
                                   reuse_port, gateway_id, api_options)
        self.http_port = self.http.port if self.http else None

    async def start(self) -> None:
        await self.grpc.start()
        if self.http is not None:
            await self.http.start()

    async def set_ready(self, engine: EngineClient, model: ModelInfo, scaler: ReplicaScaler | None = None) -> None:
        """``scaler``: what the admin route that changes the number of replicas calls (None: it answers 400)."""
        self.state.scaler = scaler
        await self.metrics.engines.start(engine)  # the engines' series for /metrics, refreshed from now on
        await self.state.set_ready(engine, model)

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, let the running ones finish (up to ``timeout`` s), then stop."""
        await self.state.start_draining()
        try:
            await asyncio.wait_for(self.state.idle.wait(), timeout)
        except asyncio.TimeoutError:
            logger.warning("drain timeout: %d request(s) still running are cancelled", self.state.in_flight)
        stops = [self.grpc.stop(grace=1.0)] + ([self.http.stop(grace=1.0)] if self.http is not None else [])
        await asyncio.gather(*stops)
        await self.metrics.engines.stop()
        self.metrics.stop_http_server()
