"""Request and response models shared by the routes: errors, usage, models, tokenize / detokenize, and the sampling
fields completions and chat have in common (OpenAI's, then vLLM's extras)."""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

# The wire format's integer ranges (the gRPC proto's uint32 / int32 / uint64): the HTTP API never hands the engine
# a number the gRPC API could not carry.
UINT32 = 2**32 - 1
INT32 = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=UINT32)]


class RequestModel(BaseModel):
    """Unknown fields are kept aside (``model_extra``): the routes ignore them with a warning, as vLLM does, or
    refuse them (400 naming them) under ``--strict-request-fields`` (see ``unknown_fields``)."""

    model_config = ConfigDict(extra="allow")


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The dotted paths of every field ``model`` and the models inside it did not declare, in request order."""
    found = [prefix + name for name in model.model_extra or ()]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                where = f"{prefix}{name}.{i}." if isinstance(value, list) else f"{prefix}{name}."
                found += unknown_fields(item, where)
    return found


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(RequestModel):
    include_usage: bool = False


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> UsageInfo:
    """``cached_tokens`` None: no prompt_tokens_details (``--enable-prompt-tokens-details`` off)."""
    details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


class LogprobEntry(BaseModel):
    """vLLM's per-token entry of ``prompt_logprobs``."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class StructuredOutputs(RequestModel):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: str | dict[str, Any] | None = Field(None, alias="json",
                                              description="A JSON schema (an object, or its JSON text).")
    json_object: bool | None = Field(None, description="Any JSON object.")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="A Lark / EBNF grammar.")
    disable_any_whitespace: bool = Field(False, description="JSON without whitespace beyond the compact form.")


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's ``response_format``: text (no constraint), any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(RequestModel):
    """What completions and chat share: OpenAI's sampling fields, then vLLM's extras."""

    model: str | None = Field(None, description="The served model's name; omitted: the served model.")
    n: int = Field(1, ge=1, le=UINT32)
    temperature: float | None = Field(None, ge=0.0, description="Default 1.0; 0 is greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Default 1.0.")
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(
        None, max_length=1024, description="Not supported by this engine: only null or an empty object is accepted.")
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=INT32, description="-1 or 0: the whole vocabulary.")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0, le=UINT32)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=UINT32)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    cache_salt: str | None = Field(None, description="Prefix-cache isolation: only requests with the same salt "
                                                     "share cached prompt blocks.")
    priority: int = Field(0, ge=-INT32 - 1, le=INT32, description=(
        "Lower runs first under the server's --scheduling-policy priority (vLLM's); anything but 0 is a 400 under the "
        "default fcfs policy."))
    request_id: str | None = Field(None, description="Names the request (at most 256 printable characters): the "
                                                      "server appends -<random hex>; the response's id has it.")
    return_token_ids: bool = Field(False, description="Add each choice's token ids and the prompt's.")
    stream_interval: int | None = Field(None, ge=1, le=UINT32, description=(
        "Streamed: a chunk per this many new tokens, raising the server's --stream-interval (the first and last "
        "chunks go out at once)."))
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None
    # vLLM's older spelling of structured_outputs (each one of its constraints): accepted, left out of the schema.
    guided_json: SkipJsonSchema[str | dict[str, Any] | None] = None
    guided_regex: SkipJsonSchema[str | None] = None
    guided_choice: SkipJsonSchema[list[str] | None] = None
    guided_grammar: SkipJsonSchema[str | None] = None

    @property
    def guided(self) -> StructuredOutputs | None:
        """The guided_* fields given, as ``structured_outputs``."""
        given = {k: v for k, v in (("json", self.guided_json), ("regex", self.guided_regex),
                                   ("choice", self.guided_choice), ("grammar", self.guided_grammar)) if v is not None}
        return StructuredOutputs(**given) if given else None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str = Field(..., description="Text to tokenize.")
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]
    skip_special_tokens: bool = True


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def error_statuses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for the error statuses a route can answer with."""
    return {s: {"model": ErrorResponse} for s in statuses}
