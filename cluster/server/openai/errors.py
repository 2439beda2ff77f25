"""Errors as OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: each of pagedserve's error types
maps to one status (and to the gRPC code name the request metrics count it under)."""
from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from pagedserve.cluster.server.internal_errors import report
from pagedserve.cluster.server.openai.protocol import ErrorInfo, ErrorResponse
from pagedserve.cluster.server.state import RETRY_AFTER_S
from pagedserve.common.errors import EngineUnavailableError, InvalidRequestError, OverloadedError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable_error"}
# The gRPC canonical code names that the request metrics count HTTP errors under.
GRPC_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED",
              429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 500: "INTERNAL"}
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    @property
    def grpc_code(self) -> str:
        return GRPC_CODES.get(self.status, "INVALID_ARGUMENT" if self.status < 500 else "INTERNAL")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=ERROR_TYPES.get(self.status, "error"),
                                             param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def _param(message: str, fields: set[str]) -> str | None:
    """The request field an engine message names first (its messages start with the field: "top_p must be ...")."""
    m = _FIELD.match(message)
    if not m:
        return None
    name = m.group(0)  # "structured_outputs.regex: ..." names the field structured_outputs
    return name if name in fields else name.split(".", 1)[0] if name.split(".", 1)[0] in fields else None


def from_exception(e: BaseException, fields: set[str] = frozenset()) -> OpenAIError:
    """Each pagedserve error type to its status; anything else is a bug: 500 with an error id (``report``)."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, InvalidRequestError):
        return OpenAIError(400, str(e), _param(str(e), fields))
    if isinstance(e, OverloadedError):
        return OpenAIError(429, str(e), code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineUnavailableError):
        return OpenAIError(503, str(e))
    return OpenAIError(500, report(e, "request"), code="internal_error")


def model_not_found(name: str, served: str) -> OpenAIError:
    return OpenAIError(404, f"the model {name!r} does not exist; this server serves {served!r}", "model",
                       "model_not_found")
