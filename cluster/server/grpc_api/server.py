"""The gRPC server: the generation service, health (``grpc.health.v1``) and server reflection, an optional API key
and TLS. Health follows the shared serving state."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from pagedserve.cluster.server.grpc_api.auth import ApiKeyInterceptor
from pagedserve.cluster.server.grpc_api.errors import InternalErrorInterceptor
from pagedserve.cluster.server.grpc_api.parsing import ParseErrorInterceptor
from pagedserve.cluster.server.grpc_api.servicer import GenerationServicer
from pagedserve.cluster.server.state import ServingState
from pagedserve.proto.v1 import generation_pb2 as pb
from pagedserve.proto.v1 import generation_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a 128k-token prompt as ids is ~0.6 MB; logprobs responses can be large
KEEPALIVE_OPTIONS = [
    # Ping idle connections so dead clients (and their streams) are noticed within ~40 s.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]

# RPCs beyond --max-concurrent-requests that the server still runs (health checks, model info, tokenize, abort, or
# generation requests that it refuses itself); past them all, gRPC answers RESOURCE_EXHAUSTED before any handler.
HEADROOM_RPCS = 64


def server_options(max_concurrent_requests: int) -> list[tuple[str, int]]:
    # gRPC core queues calls that arrive faster than the server takes them, and past its own default of 1000 such
    # pending calls it cancels the excess: uncancelled streams ending CANCELLED under a burst. The gateway's limit
    # (RESOURCE_EXHAUSTED past --max-concurrent-requests) is the one that applies, so core's sits well above it.
    pending = 2 * max_concurrent_requests + 1024
    return [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.server.max_pending_requests", pending),
            ("grpc.server.max_pending_requests_hard_limit", 2 * pending),
            *KEEPALIVE_OPTIONS]


class GrpcServer:
    def __init__(self, state: ServingState, host: str, port: int, ssl_certfile: str | None = None,
                 ssl_keyfile: str | None = None, reuse_port: bool = False) -> None:
        """The API keys are the state's. ``reuse_port``: SO_REUSEPORT, so that several gateway processes share the
        port (the kernel spreads new connections over them)."""
        interceptors = [ApiKeyInterceptor(state.keys, state.metrics)] if state.keys else []
        interceptors += [ParseErrorInterceptor(), InternalErrorInterceptor()]
        self.server = grpc.aio.server(interceptors=interceptors, options=server_options(state.max_concurrent_requests)
                                      + ([("grpc.so_reuseport", 1)] if reuse_port else []),
                                      maximum_concurrent_rpcs=state.max_concurrent_requests + HEADROOM_RPCS)
        self.servicer = GenerationServicer(state)
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
        state.listeners.append(self.set_serving)

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace=grace)
