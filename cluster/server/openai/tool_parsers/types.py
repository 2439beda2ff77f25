"""What a tool parser yields: events in output order while streaming, and the whole output's content and calls."""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass

_ALPHANUMERIC = string.ascii_letters + string.digits


def openai_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def alphanumeric_call_id(length: int = 9) -> str:
    """Mistral's chat templates insist on ids of nine letters or digits."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(length))


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A call's first delta carries its id and name (and ``arguments`` ""); the next ones carry argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


Event = ContentDelta | ToolCallDelta


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ParsedOutput:
    """``content`` None when the output was only tool calls (and whitespace around them)."""

    content: str | None
    calls: list[ToolCall]


def collect(events: list[Event]) -> ParsedOutput:
    """The events of a whole output, joined."""
    content: list[str] = []
    heads: dict[int, ToolCallDelta] = {}
    arguments: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ContentDelta):
            content.append(e.text)
            continue
        if e.name is not None:
            heads[e.index] = e
        arguments.setdefault(e.index, []).append(e.arguments)
    calls = [ToolCall(heads[i].id or "", heads[i].name or "", "".join(arguments[i])) for i in sorted(heads)]
    text = "".join(content)
    return ParsedOutput(None if calls and not text.strip() else text, calls)
