"""The tool parsers' common machine: text, a marker, then JSON call objects (one, a list, or a ``;`` sequence).

A parser is fed the generated text in pieces of any size and yields events in output order. Streaming, a call is
announced as soon as its name is known and its arguments began as an object, and the arguments then stream as they
are generated. The whole-output parse (``parse``) announces a call only once its object is complete and valid, so
text that turns out not to be a call stays content. Both read the same calls out of well-formed output, however it
is split."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto

from pagedserve.cluster.server.openai.tool_parsers.json_call import CallScanner
from pagedserve.cluster.server.openai.tool_parsers.types import (
    ContentDelta,
    Event,
    ParsedOutput,
    ToolCallDelta,
    collect,
    openai_call_id,
)

_WHITESPACE = " \t\n\r"


class ToolParser(ABC):
    """``stream``: announce calls before they are complete (see the module's doc)."""

    # The finish reason of an output that made calls ("stop" becomes this); None: the engine's.
    finish_reason: str | None = "tool_calls"

    def __init__(self, stream: bool = True) -> None:
        self.stream = stream

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """The events a delta of the model's text makes."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """The events the end of the output makes (what was held back)."""

    def parse(self, text: str) -> ParsedOutput:
        return collect(self.feed(text) + self.finish())


class _Mode(Enum):
    LEAD = auto()  # at the output's start, for formats whose calls must begin it
    TEXT = auto()  # content, looking for the marker
    CONTENT = auto()  # content to the end
    OPEN = auto()  # after the marker
    ELEMENT = auto()  # in a call object
    AFTER = auto()  # after a call object: a separator, the end marker, or the group's end


def _marker_prefix_len(text: str, marker: str) -> int:
    """The longest end of ``text`` that may begin ``marker`` (held back until the next piece tells)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


@dataclass(frozen=True)
class CallFormat:
    """How a model writes its tool calls: a parser spec, and the factory of its parsers (``fmt(stream=...)``)."""

    start: str = ""  # the marker before calls ("": none)
    start_optional: bool = False  # a leading format's calls may also begin without the marker
    end: str = ""  # the marker after each call ("one" layout)
    layout: str = "one"  # "one" object per marker, an "array" of objects, or a "sequence" of objects joined by ";"
    leading: bool = False  # calls only at the output's start; otherwise the whole output is content
    name_keys: tuple[str, ...] = ("name",)
    args_keys: tuple[str, ...] = ("arguments",)
    new_id: Callable[[], str] = openai_call_id
    # The request's skip_special_tokens, when the markers are special tokens; None: the request's own.
    skip_special_tokens: bool | None = None

    def __call__(self, stream: bool = True) -> JsonCallsParser:
        return JsonCallsParser(self, stream)

    @property
    def finish_reason(self) -> str | None:
        """Its parsers' (the chat response reads it from the factory, as ``skip_special_tokens``)."""
        return JsonCallsParser.finish_reason


class JsonCallsParser(ToolParser):
    def __init__(self, fmt: CallFormat, stream: bool = True) -> None:
        super().__init__(stream)
        self.fmt = fmt
        self._mode = _Mode.LEAD if fmt.leading else _Mode.TEXT
        self._buf = ""  # received, not yet consumed
        self._pending = ""  # consumed, not yet known to be content or a call's structure
        self._scanner: CallScanner | None = None
        self._committed = False  # the current object was announced as a call
        self._sent = 0  # how much of its arguments went out
        self._group_calls = 0  # calls announced since the last marker
        self._between = False  # after calls: whitespace is dropped unless text follows it
        self._index = 0
        self._events: list[Event] = []

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while self._buf and self._advance():
            pass
        return self._take()

    def finish(self) -> list[Event]:
        rest = self._buf if self._between else self._pending + self._buf
        if self._mode in (_Mode.LEAD, _Mode.TEXT, _Mode.CONTENT):
            self._content(rest)
        elif self._mode is _Mode.ELEMENT and self._committed:
            self._send_arguments()  # cut short: the arguments as far as they came
        elif self._mode is not _Mode.AFTER and (self._group_calls == 0 or rest.strip(_WHITESPACE + ",;")):
            self._content(rest)  # an unfinished object (or a marker with nothing after it) is text
        self._pending = self._buf = ""
        return self._take()

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _content(self, text: str) -> None:
        if text:
            self._events.append(ContentDelta(text))

    def _consume(self, n: int) -> None:
        self._pending += self._buf[:n]
        self._buf = self._buf[n:]

    def _skip_whitespace(self) -> bool:
        """Whitespace taken as pending; True when something else follows."""
        rest = self._buf.lstrip(_WHITESPACE)
        self._consume(len(self._buf) - len(rest))
        return bool(self._buf)

    def _fail(self) -> None:
        """What was held turns out to be text (the character that broke it stays in the buffer)."""
        self._content(self._pending)
        self._pending = ""
        self._scanner = None
        self._committed = False
        self._mode = _Mode.CONTENT if self.fmt.leading else _Mode.TEXT

    def _end_group(self) -> None:
        self._pending = ""
        self._mode = _Mode.CONTENT if self.fmt.leading else _Mode.TEXT
        self._between = not self.fmt.leading

    def _advance(self) -> bool:
        """One step on the buffer; False when it needs more text."""
        mode = self._mode
        if mode is _Mode.CONTENT:
            self._content(self._pending + self._buf)
            self._pending = self._buf = ""
            return False
        if mode is _Mode.TEXT:
            return self._text()
        if mode is _Mode.LEAD:
            return self._lead()
        if mode is _Mode.ELEMENT:  # the scanner skips the whitespace before the object itself
            return self._element()
        if not self._skip_whitespace():
            return False
        return self._open() if mode is _Mode.OPEN else self._after()

    def _text(self) -> bool:
        if self._between:
            if not self._skip_whitespace() or (len(self._buf) < len(self.fmt.start)
                                               and self.fmt.start.startswith(self._buf)):
                return False
            if not self._buf.startswith(self.fmt.start):
                self._content(self._pending)
            self._pending, self._between = "", False
        i = self._buf.find(self.fmt.start)
        if i < 0:
            keep = _marker_prefix_len(self._buf, self.fmt.start)
            self._content(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._content(self._buf[:i])
        self._buf = self._buf[i:]
        self._consume(len(self.fmt.start))
        self._mode, self._group_calls = _Mode.OPEN, 0
        return True

    def _lead(self) -> bool:
        rest = self._buf.lstrip(_WHITESPACE)
        if not rest:
            return False
        skipped = len(self._buf) - len(rest)
        opener = "[" if self.fmt.layout == "array" else "{"
        if self.fmt.start and rest.startswith(self.fmt.start):
            self._consume(skipped + len(self.fmt.start))
        elif self.fmt.start and self.fmt.start.startswith(rest):
            return False
        elif rest[0] == opener and (self.fmt.start_optional or not self.fmt.start):
            self._consume(skipped)
        else:
            self._mode = _Mode.CONTENT
            return True
        self._mode, self._group_calls = _Mode.OPEN, 0
        return True

    def _open(self) -> bool:
        if self.fmt.layout != "array":
            self._mode = _Mode.ELEMENT
        elif self._buf[0] == "[":
            self._consume(1)
            self._mode = _Mode.ELEMENT
        else:
            self._fail()
        return True

    def _element(self) -> bool:
        if self._scanner is None:
            if not self._buf:
                return False
            self._scanner = CallScanner(self.fmt.name_keys, self.fmt.args_keys)
        scanner = self._scanner
        n = scanner.feed(self._buf)
        if self._committed:
            self._buf = self._buf[n:]
        else:
            self._consume(n)
        if scanner.failed and not self._committed:
            self._fail()
            return True
        if not self._committed and self.stream and scanner.can_commit and not scanner.done:
            self._commit(scanner.name)
        if self._committed:
            self._send_arguments()
        if not (scanner.done or scanner.failed):
            return False
        call = scanner.call() if scanner.done else None
        if not self._committed:
            if call is None:
                self._fail()
                return True
            self._commit(call[0])
            self._events.append(ToolCallDelta(self._index - 1, call[1]))
        self._scanner, self._committed, self._mode = None, False, _Mode.AFTER
        return True

    def _commit(self, name: str) -> None:
        self._events.append(ToolCallDelta(self._index, "", self.fmt.new_id(), name))
        self._index += 1
        self._group_calls += 1
        self._committed, self._sent, self._pending = True, 0, ""

    def _send_arguments(self) -> None:
        scanner = self._scanner
        arguments = scanner.arguments_so_far
        if scanner.done and scanner.args_start is None:
            arguments = "{}"
        if len(arguments) > self._sent:
            self._events.append(ToolCallDelta(self._index - 1, arguments[self._sent:]))
            self._sent = len(arguments)

    def _after(self) -> bool:
        ch = self._buf[0]
        if self.fmt.layout == "one":
            if self.fmt.end and self._buf.startswith(self.fmt.end):
                self._consume(len(self.fmt.end))
            elif self.fmt.end and self.fmt.end.startswith(self._buf):
                return False
            self._end_group()
        elif (self.fmt.layout == "array" and ch == ",") or (self.fmt.layout == "sequence" and ch == ";"):
            self._consume(1)
            self._mode = _Mode.ELEMENT
        elif self.fmt.layout == "array" and ch == "]":
            self._consume(1)
            self._end_group()
        elif self.fmt.layout == "array":
            self._fail()
        else:
            self._end_group()
        return True
