"""Llama 3.1 / 3.2 JSON tool calls: the output begins with ``{"name": ..., "parameters": {...}}`` (after
``<|python_tag|>`` when special tokens are kept), several joined by ``;``. Output that does not begin so is
content."""
from __future__ import annotations

from pagedserve.cluster.server.openai.tool_parsers.base import JsonCallsParser


class Llama3JsonToolParser(JsonCallsParser):
    start = "<|python_tag|>"
    start_optional = True
    layout = "sequence"
    leading = True
    args_keys = ("parameters", "arguments")
