"""API-key authentication for the gRPC server."""
from __future__ import annotations

import hmac

import grpc

from pagedserve.cluster.server.api_options import api_keys
from pagedserve.cluster.server.metrics import GatewayMetrics


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer KEY`` (or ``x-api-key: KEY``) on every call but health checks,
    which load balancers and Kubernetes probes make without credentials."""

    def __init__(self, api_key: str, metrics: GatewayMetrics | None = None) -> None:
        """``api_key``: one key or a comma-separated list (see ``api_keys``)."""
        self.expected = [(f"Bearer {k}".encode(), k.encode()) for k in api_keys(api_key)]
        self.metrics = metrics

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        md = dict(details.invocation_metadata or ())
        given = [md.get("authorization", ""), md.get("x-api-key", "")]
        if any(hmac.compare_digest(g.encode(), e) for pair in self.expected for g, e in zip(given, pair) if g):
            return handler
        if self.metrics is not None and details.method.endswith("/Generate"):
            self.metrics.request("grpc").error("UNAUTHENTICATED")
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
