"""How a chat request uses its tools (``tools``, ``tool_choice``, ``parallel_tool_calls``): what the chat template
sees, what constrains the output, and which parser reads calls out of it.

"required" and a named function are enforced by structured output: a JSON list of ``{"name", "parameters"}`` (one
variant per tool), or the function's parameters schema. "auto" leaves the model free and parses its text with the
server's ``--tool-call-parser``, which vLLM also requires (with ``--enable-auto-tool-choice``)."""
from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.cluster.server.api_options import ApiOptions
from pagedserve.cluster.server.openai.chat_protocol import (
    MAX_PARAMETERS_CHARS,
    MAX_TOOLS_CHARS,
    ChatCompletionRequest,
    ChatTool,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    NamedToolChoice,
)
from pagedserve.cluster.server.openai.errors import OpenAIError
from pagedserve.cluster.server.openai.tool_parsers import TOOL_PARSER_NAMES, TOOL_PARSERS, ToolParser
from pagedserve.cluster.server.openai.tool_parsers.forced import REQUIRED_CALLS, NamedToolParser
from pagedserve.cluster.server.openai.tool_parsers.types import ContentDelta, Event
from pagedserve.common.sampling_params import StructuredOutputsParams

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
# Calls are written as json.dumps writes them (", " and ": ", no other whitespace), as tool-calling models are
# trained to: free whitespace only spends tokens, and a weak model can spend its whole budget on it. A schema that
# sets its own "x-guidance" keeps it.
_LAYOUT = {"whitespace_flexible": False, "whitespace_pattern": "", "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]] | None  # for the chat template, as the client sent them
    constraint: StructuredOutputsParams | None  # "required" or a named function
    new_parser: Callable[..., ToolParser] | None  # called with stream=...; None: the output is plain content
    parallel: bool = True  # False: calls past the first are dropped ("auto")

    @property
    def skip_special_tokens(self) -> bool | None:
        return getattr(self.new_parser, "skip_special_tokens", None)


NO_TOOLS = ToolPlan(None, None, None)


def check_auto_options(options: ApiOptions) -> None:
    """At startup: the parser named, and known."""
    if options.enable_auto_tool_choice and not options.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                         f"({', '.join(TOOL_PARSER_NAMES)})")
    if options.tool_call_parser and options.tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {options.tool_call_parser!r}: not one of "
                         f"{', '.join(TOOL_PARSER_NAMES)}")


def tools_chars(tools: list[ChatTool]) -> int:
    """The tools' size as JSON; 400 past the limits (one function's parameters, all the tools)."""
    total = 0
    for i, tool in enumerate(tools):
        params = len(json.dumps(tool.function.parameters)) if tool.function.parameters else 0
        if params > MAX_PARAMETERS_CHARS:
            raise OpenAIError(400, f"tools.{i}.function.parameters exceeds {MAX_PARAMETERS_CHARS} characters as "
                                   "JSON", "tools")
        total += params + len(tool.function.name) + len(tool.function.description or "")
        if total > MAX_TOOLS_CHARS:
            raise OpenAIError(400, f"tools exceed {MAX_TOOLS_CHARS} characters as JSON", "tools")
    return total


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or _EMPTY_PARAMETERS


def _constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    return StructuredOutputsParams(json={"x-guidance": _LAYOUT, **schema})


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """A JSON list of calls, each ``{"name": <a tool's name>, "parameters": <its schema>}``. The tools' ``$defs``
    move to the top, where their ``#/$defs/...`` references point."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        params = copy.copy(_parameters(tool))
        hoisted = params.pop("$defs") if isinstance(params.get("$defs"), dict) else {}
        for name, definition in hoisted.items():
            if defs.setdefault(name, definition) != definition:
                raise OpenAIError(400, f"tools: two functions define $defs {name!r} differently; tool_choice "
                                       "\"required\" needs them to agree", "tools")
        variants.append({"type": "object", "properties": {"name": {"const": tool.function.name},
                                                          "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _refuse_other_constraint(req: ChatCompletionRequest, choice: str) -> None:
    rf = req.response_format
    if req.structured_outputs is not None or req.guided is not None or (rf is not None and rf.type != "text"):
        raise OpenAIError(400, f"tool_choice {choice} constrains the output itself: it cannot be combined with "
                               "structured_outputs, guided_* or response_format", "tool_choice")


def plan_tools(req: ChatCompletionRequest, options: ApiOptions) -> ToolPlan:
    if req.functions and req.function_call != "none":
        raise OpenAIError(400, "functions and function_call are not supported (OpenAI deprecated them): send tools "
                               "and tool_choice", "functions")
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise OpenAIError(400, "tool_choice needs tools", "tool_choice")
        return NO_TOOLS
    tools = [t.model_dump(exclude_unset=True, by_alias=True) for t in req.tools]
    for t in tools:
        t.setdefault("type", "function")
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan(tools, None, None)
    if req.use_beam_search:
        raise OpenAIError(400, "tool calling is not available with use_beam_search", "use_beam_search")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        tool = next((t for t in req.tools if t.function.name == name), None)
        if tool is None:
            raise OpenAIError(400, f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
        _refuse_other_constraint(req, f"{{'function': {name!r}}}")
        return ToolPlan(tools, _constraint(_parameters(tool)),
                        functools.partial(NamedToolParser, name))
    if choice == "required":
        _refuse_other_constraint(req, '"required"')
        return ToolPlan(tools, _constraint(required_schema(req.tools, req.parallel_tool_calls)),
                        REQUIRED_CALLS)
    if not options.enable_auto_tool_choice or not options.tool_call_parser:
        raise OpenAIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                               'set on the server (or send tool_choice "none", "required" or a named function)',
                          "tool_choice")
    return ToolPlan(tools, None, TOOL_PARSERS[options.tool_call_parser], req.parallel_tool_calls)


def tool_deltas(events: list[Event]) -> list[DeltaMessage]:
    """Events as deltas: runs of content joined, a call's first delta alone, runs of its argument text joined."""
    deltas: list[DeltaMessage] = []
    for e in events:
        last = deltas[-1] if deltas else None
        if isinstance(e, ContentDelta):
            if last is not None and last.content is not None:
                last.content += e.text
            else:
                deltas.append(DeltaMessage(content=e.text))
        elif e.name is not None:
            deltas.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=e.index, id=e.id, type="function", function=DeltaFunctionCall(name=e.name, arguments=""))]))
        elif last is not None and last.tool_calls and last.tool_calls[0].id is None \
                and last.tool_calls[0].index == e.index:
            last.tool_calls[0].function.arguments += e.arguments
        else:
            deltas.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=e.index, function=DeltaFunctionCall(arguments=e.arguments))]))
    return deltas
