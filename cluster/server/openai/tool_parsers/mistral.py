"""Mistral: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``; text before it is content.
``[TOOL_CALLS]`` is a special token, so the output keeps special tokens, and call ids are nine letters or digits, as
Mistral's chat templates require."""
from __future__ import annotations

from pagedserve.cluster.server.openai.tool_parsers.base import JsonCallsParser
from pagedserve.cluster.server.openai.tool_parsers.types import alphanumeric_call_id


class MistralToolParser(JsonCallsParser):
    start = "[TOOL_CALLS]"
    layout = "array"
    skip_special_tokens = False
    new_id = staticmethod(alphanumeric_call_id)
