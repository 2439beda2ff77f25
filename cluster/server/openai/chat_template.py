"""Chat prompts: the messages rendered with the model's chat template (``--chat-template FILE``, else the
tokenizer's own: ``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``), by transformers'
sandboxed Jinja renderer."""
from __future__ import annotations

import inspect
import os
from typing import Any

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

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, kwargs: dict[str, Any] | None = None) -> str:
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
                messages, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(kwargs or {}))
        except Exception as e:  # the template's raise_exception, a variable it cannot use, a missing final message
            raise OpenAIError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                              "messages") from None
        if not isinstance(text, str):
            raise OpenAIError(400, "the chat template did not render to text", "messages")
        return text
