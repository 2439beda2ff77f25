"""The outputs of ``tool_choice`` "required" and a named function, which structured output constrains: a JSON list of
``{"name": ..., "parameters": {...}}``, or the named function's arguments alone."""
from __future__ import annotations

from pagedserve.cluster.server.openai.tool_parsers.base import CallFormat, ToolParser
from pagedserve.cluster.server.openai.tool_parsers.types import Event, ToolCallDelta, openai_call_id

REQUIRED_CALLS = CallFormat(layout="array", leading=True, args_keys=("parameters",))


class NamedToolParser(ToolParser):
    """The whole output is the arguments of one call (finish reason "stop", as OpenAI's)."""

    finish_reason = None

    def __init__(self, name: str, stream: bool = True) -> None:
        super().__init__(stream)
        self.name = name
        self._started = False

    def _head(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        return [ToolCallDelta(0, "", openai_call_id(), self.name)]

    def feed(self, text: str) -> list[Event]:
        return self._head() + ([ToolCallDelta(0, text)] if text else [])

    def finish(self) -> list[Event]:
        return self._head()
