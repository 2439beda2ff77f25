"""Request bodies: capped, and parsed by pydantic-core. A body larger than the cap gets 413 without being read
whole: a Content-Length over it is refused before any of the body is read, and a body without one (chunked) is
counted as it arrives and refused once past the cap. The rest of such a body is discarded by uvicorn as it comes."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pydantic_core
from fastapi import HTTPException, Request
from fastapi.routing import APIRoute
from starlette.responses import Response
from starlette.types import Message

from pagedserve.cluster.server.openai.errors import OpenAIError


class JSONRequest(Request):
    async def json(self) -> Any:
        # pydantic-core's parser, not the stdlib's: it refuses lone surrogates ("\ud800"), which no tokenizer can
        # encode, and NaN / Infinity, which JSON does not have.
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = pydantic_core.from_json(body, allow_inf_nan=False)
            except ValueError as e:
                raise json.JSONDecodeError(str(e), body.decode("utf-8", "replace"), 0) from None
        return self._json


def _too_large(limit: int) -> str:
    return f"the request body exceeds {limit} bytes (the limit follows --max-prompt-bytes)"


def capped_route(max_body_bytes: Callable[[], int]) -> type[APIRoute]:
    """A route class whose requests are JSONRequests with bodies of at most ``max_body_bytes()`` (asked per request:
    the limit follows the model's once it is loaded)."""

    class CappedRoute(APIRoute):
        def get_route_handler(self) -> Callable:
            handler = super().get_route_handler()

            async def route(request: Request) -> Response:
                limit = max_body_bytes()
                length = request.headers.get("content-length", "")
                if length.isdigit() and int(length) > limit:
                    raise OpenAIError(413, _too_large(limit))
                received = 0

                async def receive() -> Message:
                    nonlocal received
                    message = await request.receive()
                    received += len(message.get("body", b""))
                    if received > limit:
                        # HTTPException: FastAPI turns anything else raised while it reads the body into a 400.
                        raise HTTPException(413, _too_large(limit))
                    return message

                return await handler(JSONRequest(request.scope, receive))

            return route

    return CappedRoute
