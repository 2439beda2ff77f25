"""Chat prompts: the messages rendered with the model's chat template (``--chat-template FILE``, else the
tokenizer's own: ``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``), by transformers'
sandboxed Jinja renderer."""
from __future__ import annotations

import inspect
import json
import os
from typing import Any

from pagedserve.cluster.server.openai.chat_protocol import ChatMessage
from pagedserve.cluster.server.openai.errors import OpenAIError

_JINJA_MARKS = ("{{", "{%")


def load_chat_template(arg: str | None) -> str | None:
    """``--chat-template``: a file, or the template itself inline (as vLLM takes it)."""
    if arg is None:
        return None
    if os.path.isfile(arg):
        with open(arg, encoding="utf-8") as f:
            return f.read()
    if any(mark in arg for mark in _JINJA_MARKS):
        return arg
    raise ValueError(f"--chat-template {arg!r}: no such file, and not a Jinja template either")


def _template_arguments(arguments: str) -> Any:
    """A call's arguments as the chat templates take them: the object (as vLLM passes them), else the text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as Hugging Face's chat templates take it: role, content text, and any name, calls, call id."""
    message: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        message["name"] = m.name
    if m.tool_calls is not None:
        message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
            "name": c.function.name, "arguments": _template_arguments(c.function.arguments)}} for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def message_chars(m: ChatMessage) -> int:
    """A message's text and call arguments: what bounds its rendering."""
    return len(m.text()) + sum(len(c.function.arguments) for c in m.tool_calls or ())


def tokenizer_template(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one
        template = template.get("default")
    return template or None


class ChatTemplate:
    def __init__(self, tokenizer, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template or tokenizer_template(tokenizer)
        # The renderer's own parameters cannot come in as template variables.
        self.reserved = {name for name, p in inspect.signature(tokenizer.apply_chat_template).parameters.items()
                         if p.kind is not inspect.Parameter.VAR_KEYWORD} | {"messages"}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, kwargs: dict[str, Any] | None = None,
               tools: list[dict[str, Any]] | None = None) -> str:
        """``tools``: OpenAI's tool dicts, passed as Hugging Face's ``apply_chat_template(tools=...)`` does."""
        if self.template is None:
            raise OpenAIError(400, "this model has no chat template (neither chat_template.jinja nor "
                                   "tokenizer_config.json's chat_template): start the server with "
                                   "--chat-template FILE, or use /v1/completions", "messages")
        if add_generation_prompt and continue_final_message:
            raise OpenAIError(400, "add_generation_prompt and continue_final_message cannot both be true; set "
                                   "add_generation_prompt to false to continue the final message",
                              "continue_final_message")
        if continue_final_message and not messages:
            raise OpenAIError(400, "continue_final_message needs a final message", "continue_final_message")
        clash = sorted(self.reserved & set(kwargs or ()))
        if clash:
            raise OpenAIError(400, f"chat_template_kwargs: {clash} are reserved", "chat_template_kwargs")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=self.template, tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **(kwargs or {}))
        except Exception as e:  # the template's raise_exception, a variable it cannot use, a missing final message
            raise OpenAIError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                              "messages") from None
        if not isinstance(text, str):
            raise OpenAIError(400, "the chat template did not render to text", "messages")
        return text
