"""Server-sent events: ``data: {json}\\n\\n`` per chunk, ``data: [DONE]\\n\\n`` last. The response watches the
connection: a client that goes away cancels the stream at once (which aborts its engine requests), not only when
the next chunk fails to send."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pagedserve.cluster.server.openai.errors import OpenAIError, from_exception

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def event(chunk: BaseModel) -> bytes:
    return b"data: " + chunk.model_dump_json().encode() + b"\n\n"


async def sse_events(chunks: AsyncIterator[list[BaseModel]], on_error: Callable[[OpenAIError], None],
                     fields: set[str] = frozenset()) -> AsyncIterator[bytes]:
    """One write per engine step (its chunks joined). An error once streaming began goes out as one error event,
    then ``[DONE]``: the status line has been sent already."""
    try:
        async for batch in chunks:
            if batch:
                yield b"".join(event(c) for c in batch)
    except Exception as e:
        err = from_exception(e, fields)
        on_error(err)
        yield event(err.body())
    yield DONE


async def wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[], Awaitable[None]]) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for data in self.events:
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = asyncio.ensure_future(self._send_all(send))
        watching = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait((sending, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sending.cancel()
            watching.cancel()
            for t in (sending, watching):
                try:
                    await t
                except (asyncio.CancelledError, OSError):
                    pass
                except Exception:  # a bug in building the chunks: the client sees the stream end
                    logger.exception("event stream failed")
            await self.events.aclose()  # suspended at a yield when the send was cancelled: close it now
            await self.on_close()
