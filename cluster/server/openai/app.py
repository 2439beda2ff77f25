"""The FastAPI application: routes, API-key check, and every error as OpenAI's error body (request validation
included: 400, not FastAPI's 422)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from pagedserve import __version__
from pagedserve.cluster.server.api_options import ApiOptions
from pagedserve.cluster.server.openai.admin import add_admin_routes
from pagedserve.cluster.server.openai.chat_protocol import ChatCompletionRequest, ChatCompletionResponse
from pagedserve.cluster.server.openai.chat_template import ChatTemplate
from pagedserve.cluster.server.openai.completion_protocol import CompletionRequest, CompletionResponse
from pagedserve.cluster.server.openai.errors import OpenAIError, from_exception
from pagedserve.cluster.server.openai.generation import (
    REQUEST_CALLER,
    Caller,
    ClientDisconnected,
    served_model,
    until_disconnect,
)
from pagedserve.cluster.server.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    error_statuses,
)
from pagedserve.cluster.server.openai.request_body import capped_route
from pagedserve.cluster.server.openai.serving_chat import FIELDS as CHAT_FIELDS
from pagedserve.cluster.server.openai.serving_chat import ChatServing
from pagedserve.cluster.server.openai.serving_completions import FIELDS as COMPLETION_FIELDS
from pagedserve.cluster.server.openai.serving_completions import CompletionServing
from pagedserve.cluster.server.openai.unknown_fields import UnknownFields
from pagedserve.cluster.server.state import ServingState
from pagedserve.common.config import utf8_size_over
from pagedserve.common.errors import EngineUnavailableError
from pagedserve.engine.protocol import EngineClient

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
INLINE_TOKENIZE_CHARS = 16_384
INLINE_DETOKENIZE_IDS = 4096
CLIENT_CLOSED = 499  # nginx's "client closed request": never seen by the client, which is gone
_EVENT_STREAM = {"text/event-stream": {"schema": {"type": "string", "description": "`data: {chunk}` events, then "
                                                                                   "`data: [DONE]`"}}}


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    parts, param = [], None
    for err in exc.errors()[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or where or None
        if err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {(err.get('ctx') or {}).get('error') or err.get('msg')}")
            param = None
        else:
            parts.append(f"{where or 'body'}: {err.get('msg')}")
    more = len(exc.errors()) - 3
    return OpenAIError(400, "; ".join(parts) + (f" (and {more} more)" if more > 0 else ""), param)


def _ready(state: ServingState) -> EngineClient:
    try:
        return state.ready_engine()
    except EngineUnavailableError as e:
        raise OpenAIError(503, str(e)) from None


async def _generation(state: ServingState, request: Request, create: Callable[[], Awaitable[Response]],
                      fields: set[str]) -> Response:
    """``create()``: the route's work, with the caller (API key and tenant) in its context."""
    try:
        key = getattr(request.state, "api_key_index", None)
        header = state.tenants.header
        # Set before until_disconnect's task copies the context.
        REQUEST_CALLER.set(Caller(key, state.tenant_of(key, request.headers.get(header) if header else None)))
        return await until_disconnect(request.receive, create())
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    except Exception as e:
        raise from_exception(e, fields) from None


def build_app(state: ServingState, chat_template: str | None = None, options: ApiOptions = ApiOptions()) -> FastAPI:
    """Requires one of the state's API keys, if it has any."""
    docs = {} if not options.disable_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="pagedserve", version=__version__,
                  description="OpenAI-compatible API of a pagedserve gateway (the gRPC API's twin).", **docs)
    app.router.route_class = capped_route(lambda: state.max_body_bytes)
    completions = CompletionServing(state)
    chat = ChatServing(state, ChatTemplate(state.tokenizer, chat_template))
    unknown = UnknownFields(options.strict_request_fields)
    deps = []
    auth = (401,) if state.keys else ()
    if state.keys:
        bearer = HTTPBearer(auto_error=False, description="--api-key, or a tenant's key")

        async def require_api_key(request: Request,
                                  creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
            index = state.keys.match(creds.credentials if creds is not None else None)
            if index is None:
                raise OpenAIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")
            request.state.api_key_index = index  # its tenant, and whose requests it may abort

        deps = [Depends(require_api_key)]

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> Response:
        if request.method == "POST" and request.url.path in GENERATION_PATHS:
            state.metrics.request("http").error(exc.grpc_code)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return await openai_error(request, _validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return await openai_error(request, OpenAIError(exc.status_code, str(exc.detail), headers=exc.headers))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        return await openai_error(request, from_exception(exc))

    generation_errors = error_statuses(400, *auth, 404, 413, 429, 500, 503)

    @app.post("/v1/completions", dependencies=deps, response_model=CompletionResponse,
              responses={200: {"content": _EVENT_STREAM}, **generation_errors})
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        ignored = unknown.check(body)
        response = await _generation(state, request,
                                     lambda: completions.create(body, request.headers.get("x-session-id")),
                                     COMPLETION_FIELDS)
        response.headers.update(ignored)
        return response

    @app.post("/v1/chat/completions", dependencies=deps, response_model=ChatCompletionResponse,
              responses={200: {"content": _EVENT_STREAM}, **generation_errors})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        ignored = unknown.check(body)
        response = await _generation(state, request, lambda: chat.create(body, request.headers.get("x-session-id")),
                                     CHAT_FIELDS)
        response.headers.update(ignored)
        return response

    @app.get("/v1/models", dependencies=deps, response_model=ModelList, responses=error_statuses(*auth, 503))
    async def list_models() -> ModelList:
        engine = _ready(state)
        return ModelList(data=[ModelCard(id=state.model.name, root=state.model.info.model,
                                         max_model_len=engine.info.max_model_len)])

    @app.get("/health", response_class=Response,
             responses={200: {"description": "Serving."}, 503: {"model": ErrorResponse, "description": "Loading, "
                        "draining, or no model replica can take requests."}})
    async def health() -> Response:
        if not state.serving:
            raise OpenAIError(503, f"not serving: {state.not_serving_reason}")
        return Response(status_code=200)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text format: the same registry as --metrics-port."}})
    async def metrics() -> Response:
        # The engines' series come from a snapshot (never a call to them); the text is still built off the event
        # loop, which streams tokens meanwhile.
        body = await asyncio.to_thread(generate_latest, state.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", dependencies=deps, response_model=TokenizeResponse,
              responses=error_statuses(400, *auth, 404, 413, 503))
    async def tokenize(body: TokenizeRequest, response: Response) -> TokenizeResponse:
        response.headers.update(unknown.check(body))
        engine = _ready(state)
        served_model(state, body.model)
        limit = engine.info.limits.max_prompt_bytes
        if utf8_size_over(body.prompt, limit) is not None:
            raise OpenAIError(400, f"prompt exceeds {limit} bytes (max_prompt_bytes)", "prompt")
        tok = state.tokenizer

        def run() -> list[int]:
            return tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)

        try:
            ids = await asyncio.to_thread(run) if len(body.prompt) > INLINE_TOKENIZE_CHARS else run()
        except UnicodeEncodeError:
            raise OpenAIError(400, "prompt is not valid Unicode text (unpaired surrogates)", "prompt") from None
        return TokenizeResponse(count=len(ids), max_model_len=engine.info.max_model_len, tokens=ids,
                                token_strs=tok.convert_ids_to_tokens(ids) if body.return_token_strs else None)

    @app.post("/detokenize", dependencies=deps, response_model=DetokenizeResponse,
              responses=error_statuses(400, *auth, 404, 413, 503))
    async def detokenize(body: DetokenizeRequest, response: Response) -> DetokenizeResponse:
        response.headers.update(unknown.check(body))
        _ready(state)
        served_model(state, body.model)
        vocab, limit = len(state.tokenizer), state.max_token_ids
        if len(body.tokens) > limit:
            raise OpenAIError(400, f"tokens: {len(body.tokens)} ids, more than max_model_len ({limit})", "tokens")
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise OpenAIError(400, f"tokens: {bad[:5]} outside the vocabulary [0, {vocab})", "tokens")

        def run() -> DetokenizeResponse:
            return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens,
                                                                    skip_special_tokens=body.skip_special_tokens))

        return await asyncio.to_thread(run) if len(body.tokens) > INLINE_DETOKENIZE_IDS else run()

    add_admin_routes(app, state, deps, auth)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    base_openapi = app.openapi

    def openapi() -> dict:
        """FastAPI documents a 422 for every body; this API answers 400 (ErrorResponse) instead."""
        if app.openapi_schema is None:
            schema = base_openapi()
            for path in schema["paths"].values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema

    app.openapi = openapi
    return app
