"""Request fields this server does not know: ignored, with one warning log line per field name and a response header
naming them (vLLM ignores them with a warning; clients send fields such as ``metadata`` or ``store`` everywhere), or
refused with a 400 naming them under ``--strict-request-fields``."""
from __future__ import annotations

import logging

from pydantic import BaseModel

from pagedserve.cluster.server.openai.errors import OpenAIError
from pagedserve.cluster.server.openai.protocol import unknown_fields

logger = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "x-pagedserve-ignored-fields"
MAX_WARNED = 1024  # distinct names logged once each; names beyond it are not logged (a client inventing names)
HEADER_NAMES = 16  # named in the header, then "..."
NAME_CHARS = 64  # of each name, in the header and the log


def _shown(name: str) -> str:
    """Printable ASCII: control characters and the rest escaped (no header or log line injection)."""
    return name[:NAME_CHARS].encode("unicode_escape").decode("ascii")


class UnknownFields:
    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self._warned: set[str] = set()

    def check(self, body: BaseModel) -> dict[str, str]:
        """The response headers naming the fields of ``body`` that were ignored ({} when none); raises a 400
        when strict."""
        names = unknown_fields(body)
        if not names:
            return {}
        if self.strict:
            more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
            raise OpenAIError(400, "; ".join(f"{_shown(n)}: Extra inputs are not permitted" for n in names[:3]) + more,
                              _shown(names[0]))
        for name in names:
            if name not in self._warned and len(self._warned) < MAX_WARNED:
                self._warned.add(name)
                logger.warning("ignoring the request field %r, which this server does not know (logged once; "
                               "--strict-request-fields refuses such requests)", _shown(name))
        shown = ", ".join(_shown(n) for n in names[:HEADER_NAMES])
        return {IGNORED_FIELDS_HEADER: shown + (", ..." if len(names) > HEADER_NAMES else "")}
