"""API-key authentication for the gRPC server, and which of the keys a call presents (the tenant it names; an Abort
only reaches the requests made with the same key)."""
from __future__ import annotations

import grpc

from pagedserve.cluster.server.api_keys import KeyTable
from pagedserve.cluster.server.metrics import GatewayMetrics

BEARER = "Bearer "


def metadata_value(metadata, key: str) -> str | None:
    """The first text value of ``key`` in a call's metadata (keys arrive lowercased), None if absent."""
    for k, v in metadata or ():
        if k == key and isinstance(v, str):
            return v
    return None


def caller(keys: KeyTable, metadata) -> int | None:
    """The index of the key that ``metadata`` presents (``authorization: Bearer KEY`` or ``x-api-key: KEY``), None
    if none. Every key is compared, whichever matches."""
    auth = metadata_value(metadata, "authorization") or ""
    return keys.match(auth[len(BEARER):] if auth.startswith(BEARER) else None, metadata_value(metadata, "x-api-key"))


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Requires one of the keys on every call but health checks, which load balancers and Kubernetes probes make
    without credentials."""

    def __init__(self, keys: KeyTable, metrics: GatewayMetrics | None = None) -> None:
        self.keys = keys
        self.metrics = metrics

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        if caller(self.keys, details.invocation_metadata) is not None:
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
