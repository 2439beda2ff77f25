"""``POST /v1/completions``: the request and the response (whole, and as streamed chunks)."""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

from pagedserve.cluster.server.openai.protocol import UINT32, LogprobEntry, SamplingRequest, TokenId, UsageInfo


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        ..., description="Text, a list of texts, token ids, or a list of token-id lists (a batch).")
    max_tokens: int | None = Field(16, ge=1, le=UINT32, description="Default 16; null: up to max_model_len.")
    best_of: int | None = Field(None, ge=1, le=UINT32)
    echo: bool = Field(False, description="Prepend the prompt to each choice's text (and its logprobs to "
                                          "the choice's logprobs, the first token's null).")
    logprobs: int | None = Field(None, ge=0, le=UINT32, description="Top logprobs per token.")


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = Field(None, description="stop, length or abort; null while streaming.")
    stop_reason: int | str | None = Field(None, description="The stop token id or stop string that ended it.")
    token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)
    prompt_token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)
    prompt_logprobs: list[dict[str, LogprobEntry] | None] | None = Field(None, exclude_if=lambda v: v is None)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
