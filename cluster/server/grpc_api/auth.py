"""API-key authentication for the gRPC server, and which of the keys a call presents (an Abort only reaches the
requests made with the same key)."""
from __future__ import annotations

import hmac

import grpc

from pagedserve.cluster.server.api_options import api_keys
from pagedserve.cluster.server.metrics import GatewayMetrics


class ApiKeys:
    """The configured keys (``api_key``: one, or a comma-separated list, see ``api_keys``); none: no key needed."""

    def __init__(self, api_key: str | None) -> None:
        self.expected = [(f"Bearer {k}".encode(), k.encode()) for k in api_keys(api_key)]

    def __bool__(self) -> bool:
        return bool(self.expected)

    def caller(self, metadata) -> int | None:
        """The index of the key that ``metadata`` presents (``authorization: Bearer KEY`` or ``x-api-key: KEY``),
        None if none. Every key is compared, whichever matches."""
        md = {k: v for k, v in metadata or () if isinstance(v, str)}
        given = [md.get("authorization", "").encode(), md.get("x-api-key", "").encode()]
        matches = [any([bool(g) and hmac.compare_digest(g, e) for g, e in zip(given, pair)])
                   for pair in self.expected]
        return matches.index(True) if True in matches else None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Requires one of the keys on every call but health checks, which load balancers and Kubernetes probes make
    without credentials."""

    def __init__(self, keys: ApiKeys, metrics: GatewayMetrics | None = None) -> None:
        self.keys = keys
        self.metrics = metrics

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        if self.keys.caller(details.invocation_metadata) is not None:
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
