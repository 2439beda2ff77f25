"""Requests that do not parse get INVALID_ARGUMENT naming the message. grpc parses a request before the handler
runs, and a ``DecodeError`` there comes back UNKNOWN ("Unexpected DecodeError"); so the handlers here receive the
raw bytes and parse them themselves."""
from __future__ import annotations

import inspect

import grpc


def _message_name(parse) -> str:
    return getattr(getattr(parse, "__self__", None), "__name__", "the request message")


class ParseErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        parse = handler.request_deserializer
        what = _message_name(parse)

        async def parsed(raw: bytes, context: grpc.aio.ServicerContext):
            try:
                return parse(raw)
            except Exception as e:  # DecodeError, or anything else a malformed message raises
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request does not parse as {what}: {e}")

        kw = {"request_deserializer": None, "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(raw, context):
                return await inner(await parsed(raw, context), context)

            return grpc.unary_unary_rpc_method_handler(unary, **kw)
        inner_stream = handler.unary_stream

        async def stream(raw, context):
            responses = inner_stream(await parsed(raw, context), context)
            if inspect.isasyncgen(responses):
                async for response in responses:
                    yield response
            else:  # a coroutine that writes its responses (context.write), as health's Watch
                await responses

        return grpc.unary_stream_rpc_method_handler(stream, **kw)
