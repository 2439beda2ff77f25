"""A bug in any handler ends its call INTERNAL with an error id (``internal_errors.report``), never grpc's default
UNKNOWN "Unexpected <type>: <message>", which hands the exception's text (paths, other requests' data) to the
client. Aborts a handler makes itself, and cancellations, pass through."""
from __future__ import annotations

import inspect

import grpc

from pagedserve.cluster.server.internal_errors import report


class InternalErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_streaming:  # this API has no client-streaming method
            return handler
        method = details.method.rsplit("/", 1)[-1]
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context: grpc.aio.ServicerContext):
                try:
                    return await inner(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as e:
                    await context.abort(grpc.StatusCode.INTERNAL, report(e, method))

            return grpc.unary_unary_rpc_method_handler(unary, **kw)
        inner_stream = handler.unary_stream

        async def stream(request, context: grpc.aio.ServicerContext):
            try:
                responses = inner_stream(request, context)
                if inspect.isasyncgen(responses):
                    async for response in responses:
                        yield response
                else:  # a coroutine that writes its responses (context.write), as health's Watch
                    await responses
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await context.abort(grpc.StatusCode.INTERNAL, report(e, method))

        return grpc.unary_stream_rpc_method_handler(stream, **kw)
