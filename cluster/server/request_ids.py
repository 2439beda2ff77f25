"""The engine request id of a generation request. A client may name its request (gRPC ``request_id``, the HTTP body's
``request_id``); the server always appends a random suffix of its own, as vLLM does (``<client id>-<16 hex>``), so
that two clients choosing the same id neither collide (one refused as "already running") nor reach each other's
request (an Abort naming the bare client id finds nothing). The id the server uses is reported back: the gRPC
responses' ``request_id``, the HTTP response's ``id`` (``cmpl-<id>``, ``chatcmpl-<id>``)."""
from __future__ import annotations

import secrets
import uuid

from pagedserve.common.errors import InvalidRequestError

# Longer client ids are refused (INVALID_ARGUMENT / 400), not truncated: a truncated id would silently differ from
# the one the client logged. The id also goes into the server's log lines, hence printable characters only.
MAX_CLIENT_REQUEST_ID_CHARS = 256


def server_request_id(client_id: str | None) -> str:
    """``<client_id>-<random hex>``, or a random id when the client named none; raises InvalidRequestError for a
    client id over MAX_CLIENT_REQUEST_ID_CHARS characters or with unprintable ones."""
    if not client_id:
        return uuid.uuid4().hex
    if len(client_id) > MAX_CLIENT_REQUEST_ID_CHARS:
        raise InvalidRequestError(f"request_id: {len(client_id)} characters, more than "
                                  f"{MAX_CLIENT_REQUEST_ID_CHARS}")
    if not client_id.isprintable():
        raise InvalidRequestError("request_id: only printable characters")
    return f"{client_id}-{secrets.token_hex(8)}"
