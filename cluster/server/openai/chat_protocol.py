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
# Tool calling
MAX_TOOLS = 128
MAX_TOOLS_CHARS = 1024 * 1024  # all the tools as JSON
MAX_PARAMETERS_CHARS = 64 * 1024  # one function's parameters schema as JSON
MAX_TOOL_CALLS = 128  # in one assistant message
MAX_ARGUMENTS_CHARS = 64 * 1024  # one call's arguments
MAX_TOOL_CALL_ID_CHARS = 256


class FunctionCall(RequestModel):
    name: str = Field(..., min_length=1, max_length=MAX_NAME_CHARS)
    arguments: str = Field(..., max_length=MAX_ARGUMENTS_CHARS, description="The arguments as JSON text.")


class MessageToolCall(RequestModel):
    """A call the assistant made earlier in the conversation."""

    id: str = Field(..., max_length=MAX_TOOL_CALL_ID_CHARS)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: str = Field(..., max_length=MAX_ROLE_CHARS,
                      description="system, developer, user, assistant or tool: as the chat template knows them.")
    content: str | list[TextContentPart] | None = None
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)
    tool_calls: list[MessageToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS,
                                                     description="An assistant message's calls.")
    tool_call_id: str | None = Field(None, max_length=MAX_TOOL_CALL_ID_CHARS,
                                     description="A tool message: the call it answers.")

    def text(self) -> str:
        """The content as one string (text parts joined by newlines), as chat templates expect."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(RequestModel):
    name: str = Field(..., min_length=1, max_length=MAX_NAME_CHARS)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments (an object).")
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str = Field(..., max_length=MAX_NAME_CHARS)


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


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
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='Default: "auto" with tools ("auto" needs the server\'s --enable-auto-tool-choice), '
                          'else "none". "required" and a named function constrain the output to calls.')
    parallel_tool_calls: bool = Field(True, description="Let the model make several calls at once.")
    # OpenAI's deprecated spelling: refused (unless function_call is "none") rather than ignored, since a client that
    # sends functions expects calls back.
    functions: SkipJsonSchema[list[dict[str, Any]] | None] = None
    function_call: SkipJsonSchema[str | dict[str, Any] | None] = None


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobContent(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprobContent] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str = Field(..., description="JSON text.")


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ResponseToolCall] | None = Field(None, exclude_if=lambda v: v is None)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = Field(None, description="stop, length, tool_calls or abort.")
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


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(None, exclude_if=lambda v: v is None)
    arguments: str | None = Field(None, exclude_if=lambda v: v is None)


class DeltaToolCall(BaseModel):
    """A call's first delta has its id, type and name (arguments ""); the next ones only argument text."""

    index: int
    id: str | None = Field(None, exclude_if=lambda v: v is None)
    type: Literal["function"] | None = Field(None, exclude_if=lambda v: v is None)
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = Field(None, exclude_if=lambda v: v is None)
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=lambda v: v is None)


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
