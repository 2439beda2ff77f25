"""``POST /v1/chat/completions``: messages, the request, and the response (whole, and as streamed chunks)."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic.json_schema import SkipJsonSchema

from pagedserve.cluster.server.openai.protocol import (
    UINT32,
    LogprobEntry,
    RequestModel,
    SamplingRequest,
    UsageInfo,
)


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


MAX_ROLE_CHARS = 64
MAX_NAME_CHARS = 256
MAX_TEMPLATE_KWARGS_CHARS = 64 * 1024  # chat_template_kwargs as JSON


class ChatMessage(RequestModel):
    role: str = Field(..., max_length=MAX_ROLE_CHARS,
                      description="system, developer, user, assistant or tool: as the chat template knows them.")
    content: str | list[TextContentPart] | None = None
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)

    def text(self) -> str:
        """The content as one string (text parts joined by newlines), as chat templates expect."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32,
                                              description="Default: up to max_model_len.")
    max_tokens: int | None = Field(None, ge=1, le=UINT32, description="The older name of max_completion_tokens.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=UINT32, description="With logprobs: the top tokens per position.")
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="End the prompt inside the final (assistant) message, "
                                                            "which the model then continues.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra variables for the chat template.")
    # Declared (and left out of the schema) so that they are refused rather than ignored: a client that sends tools
    # expects tool calls back. Only with tool_choice "none" until tool calling lands.
    tools: SkipJsonSchema[list[dict[str, Any]] | None] = None
    tool_choice: SkipJsonSchema[str | dict[str, Any] | None] = None
    functions: SkipJsonSchema[list[dict[str, Any]] | None] = None
    function_call: SkipJsonSchema[str | dict[str, Any] | None] = None

    @property
    def wants_tool_calls(self) -> bool:
        tools = bool(self.tools) and self.tool_choice != "none"
        return tools or (bool(self.functions) and self.function_call != "none")


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobContent(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprobContent] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = Field(None, description="stop, length or abort.")
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)
    prompt_logprobs: list[dict[str, LogprobEntry] | None] | None = Field(None, exclude_if=lambda v: v is None)
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)
    prompt_logprobs: list[dict[str, LogprobEntry] | None] | None = Field(None, exclude_if=lambda v: v is None)
