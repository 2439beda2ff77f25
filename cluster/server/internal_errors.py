"""A bug's answer to the client: a generic message with an error id. The detail (the exception and its traceback)
goes to the log under the same id, never to the client: it can hold paths, prompts or other requests' data."""
from __future__ import annotations

import logging
import uuid

logger = logging.getLogger(__name__)


def report(e: BaseException, what: str) -> str:
    """Log ``e`` with a new error id; the message for the client, naming the id."""
    error_id = uuid.uuid4().hex[:16]
    logger.error("%s failed (error id %s)", what, error_id, exc_info=e)
    return f"internal error (id {error_id}); the server's log has the detail"
