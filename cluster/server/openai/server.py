"""uvicorn serving the HTTP API on the gateway's own event loop (uvloop under ``pagedserve serve``), its socket
bound when constructed so that a taken port fails the gateway at once, as gRPC's does."""
from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from pagedserve.cluster.server.api_options import ApiOptions
from pagedserve.cluster.server.openai.app import build_app
from pagedserve.cluster.server.openai.chat_template import load_chat_template
from pagedserve.cluster.server.state import ServingState

logger = logging.getLogger(__name__)


GATEWAY_HEADER = b"x-pagedserve-gateway"
# Connections beyond --max-concurrent-requests that uvicorn still serves (health checks, /metrics, idle keep-alive
# connections, requests the gateway refuses itself with 429); past them all it answers 503 before the app runs.
HEADROOM_CONNECTIONS = 128


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=2048, reuse_port=reuse_port)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port} for HTTP: {e}") from None
    sock.setblocking(False)
    return sock


class HttpServer:
    def __init__(self, state: ServingState, host: str, port: int, ssl_certfile: str | None = None,
                 ssl_keyfile: str | None = None, chat_template: str | None = None, reuse_port: bool = False,
                 gateway_id: str | None = None, options: ApiOptions = ApiOptions()) -> None:
        """The API keys are the state's. ``reuse_port``: see ``GrpcServer``; ``gateway_id``: sent in every response's
        x-pagedserve-gateway header (which of several gateway processes answered)."""
        if bool(ssl_certfile) != bool(ssl_keyfile):
            raise ValueError("TLS needs both --ssl-certfile and --ssl-keyfile")
        self.app = build_app(state, load_chat_template(chat_template), options)
        if gateway_id is not None:
            self.app = _tag_responses(self.app, gateway_id.encode())
        # lifespan off: the gateway owns start-up and shutdown. No access log: a line per request costs the event
        # loop that streams tokens.
        self.config = uvicorn.Config(self.app, host=host, port=port, loop="none", http="httptools", ws="none",
                                     lifespan="off", access_log=False, log_level="warning", ssl_certfile=ssl_certfile,
                                     ssl_keyfile=ssl_keyfile, timeout_keep_alive=30,
                                     limit_concurrency=state.max_concurrent_requests + HEADROOM_CONNECTIONS)
        self.server = uvicorn.Server(self.config)
        self.sock = bind(host, port, reuse_port)
        self.port = self.sock.getsockname()[1]
        self.scheme = "https" if ssl_certfile else "http"
        self._ticker: asyncio.Task | None = None

    async def start(self) -> None:
        self.config.load()
        self.server.lifespan = self.config.lifespan_class(self.config)
        # startup() and main_loop() rather than serve(): serve() would take over SIGINT/SIGTERM, which belong to
        # the gateway's drain.
        await self.server.startup(sockets=[self.sock])
        self._ticker = asyncio.ensure_future(self.server.main_loop())

    async def stop(self, grace: float) -> None:
        """Close the listener and idle connections; requests still running get ``grace`` seconds, then are
        cancelled (which aborts their engine requests)."""
        if self._ticker is None:
            self.sock.close()
            return
        self.server.should_exit = True
        await self._ticker
        self.config.timeout_graceful_shutdown = grace
        await self.server.shutdown(sockets=[self.sock])


def _tag_responses(app, value: bytes):
    """The ASGI app with a header naming this gateway added to every HTTP response."""
    async def tagged(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (GATEWAY_HEADER, value)]}
            await send(message)

        return await app(scope, receive, send_tagged)

    return tagged
