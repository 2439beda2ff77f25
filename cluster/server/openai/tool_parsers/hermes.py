"""Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as many as the model makes; the text
around them is content."""
from __future__ import annotations

from pagedserve.cluster.server.openai.tool_parsers.base import JsonCallsParser


class HermesToolParser(JsonCallsParser):
    start = "<tool_call>"
    end = "</tool_call>"
    layout = "one"
