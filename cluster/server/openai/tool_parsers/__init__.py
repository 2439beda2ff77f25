"""Tool-call parsers for chat completions with ``tool_choice`` "auto", by vLLM's ``--tool-call-parser`` names."""
from __future__ import annotations

from pagedserve.cluster.server.openai.tool_parsers.base import CallFormat, ToolParser
from pagedserve.cluster.server.openai.tool_parsers.types import alphanumeric_call_id

TOOL_PARSERS: dict[str, CallFormat] = {
    # Hermes / Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, as many as the model makes; the text
    # around them is content.
    "hermes": CallFormat(start="<tool_call>", end="</tool_call>", layout="one"),
    # Llama 3.1 / 3.2 JSON: the output begins with {"name": ..., "parameters": {...}} (after <|python_tag|> when
    # special tokens are kept), several joined by ";". Output that does not begin so is content.
    "llama3_json": CallFormat(start="<|python_tag|>", start_optional=True, layout="sequence", leading=True,
                              args_keys=("parameters", "arguments")),
    # Mistral: [TOOL_CALLS] then a JSON list of {"name": ..., "arguments": {...}}; text before it is content.
    # [TOOL_CALLS] is a special token, so the output keeps special tokens, and call ids are nine letters or digits,
    # as Mistral's chat templates require.
    "mistral": CallFormat(start="[TOOL_CALLS]", layout="array", skip_special_tokens=False,
                          new_id=alphanumeric_call_id),
}
TOOL_PARSER_NAMES: list[str] = sorted(TOOL_PARSERS)  # the --tool-call-parser choices

__all__ = ["TOOL_PARSERS", "TOOL_PARSER_NAMES", "CallFormat", "ToolParser"]
