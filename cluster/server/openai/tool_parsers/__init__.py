"""Tool-call parsers for chat completions with ``tool_choice`` "auto", by vLLM's ``--tool-call-parser`` names."""
from __future__ import annotations

from pagedserve.cluster.server.openai.tool_parsers.base import ToolParser
from pagedserve.cluster.server.openai.tool_parsers.hermes import HermesToolParser
from pagedserve.cluster.server.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedserve.cluster.server.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}
TOOL_PARSER_NAMES: list[str] = sorted(TOOL_PARSERS)  # the --tool-call-parser choices
