"""One JSON object that may be a tool call, read as it is generated: the name as soon as its string is complete,
the arguments' raw text as it grows. Only the object's top level is parsed; nested values are skipped by counting
brackets outside strings, and the whole is checked with ``json.loads`` once it is closed."""
from __future__ import annotations

import json
from enum import Enum, auto

_WHITESPACE = " \t\n\r"
_SCALAR = frozenset("-+.0123456789eEtrufalsn")  # numbers, true, false, null


class _State(Enum):
    OPEN = auto()  # before "{"
    FIRST_KEY = auto()  # after "{": a key or "}"
    KEY_START = auto()  # after ",": a key
    KEY = auto()
    COLON = auto()
    VALUE = auto()
    STRING = auto()
    NESTED = auto()
    SCALAR = auto()
    AFTER_VALUE = auto()  # "," or "}"
    DONE = auto()
    FAILED = auto()


class CallScanner:
    def __init__(self, name_keys: tuple[str, ...], args_keys: tuple[str, ...]) -> None:
        self.name_keys = name_keys
        self.args_keys = args_keys
        self.text = ""  # what was consumed
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self._state = _State.OPEN
        self._token_start = 0
        self._key: str | None = None
        self._depth = 0
        self._in_string = False
        self._escaped = False

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    @property
    def failed(self) -> bool:
        return self._state is _State.FAILED

    def feed(self, s: str) -> int:
        """Consume ``s`` up to the object's closing brace; returns how many characters were taken. A character that
        cannot continue the object is not taken (``failed`` is then set)."""
        base = len(self.text)
        text = self.text + s
        i = 0
        while i < len(s) and self._state not in (_State.DONE, _State.FAILED):
            if self._step(text, base + i, s[i]):
                i += 1
        self.text = text[:base + i]
        return i

    def _step(self, text: str, pos: int, ch: str) -> bool:
        """One character; False when it must be seen again in the new state (the end of a bare scalar)."""
        st = self._state
        if st in (_State.STRING, _State.KEY) or (st is _State.NESTED and self._in_string):
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                if st is _State.KEY:
                    return self._end_key(text[self._token_start:pos + 1])
                if st is _State.STRING:
                    self._end_value(text, pos + 1)
                else:
                    self._in_string = False
            return True
        if st is _State.NESTED:
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._end_value(text, pos + 1)
            return True
        if st is _State.SCALAR:
            if ch in _SCALAR:
                return True
            self._end_value(text, pos)
            return False
        if ch in _WHITESPACE:
            return True
        if st is _State.OPEN:
            self._state = _State.FIRST_KEY if ch == "{" else _State.FAILED
        elif st in (_State.FIRST_KEY, _State.KEY_START):
            if ch == '"':
                self._state, self._token_start = _State.KEY, pos
            else:
                self._state = _State.DONE if ch == "}" and st is _State.FIRST_KEY else _State.FAILED
        elif st is _State.COLON:
            self._state = _State.VALUE if ch == ":" else _State.FAILED
        elif st is _State.VALUE:
            self._start_value(pos, ch)
        elif st is _State.AFTER_VALUE:
            self._state = _State.KEY_START if ch == "," else _State.DONE if ch == "}" else _State.FAILED
        return self._state is not _State.FAILED

    def _end_key(self, raw: str) -> bool:
        try:
            self._key = json.loads(raw)
        except ValueError:
            self._state = _State.FAILED
            return False
        self._state = _State.COLON
        return True

    def _start_value(self, pos: int, ch: str) -> None:
        self._token_start = pos
        if self._key in self.args_keys and self.args_start is None:
            self.args_start = pos
        if ch == '"':
            self._state = _State.STRING
        elif ch in "{[":
            self._state, self._depth, self._in_string = _State.NESTED, 1, False
        elif ch in _SCALAR:
            self._state = _State.SCALAR
        else:
            self._state = _State.FAILED

    def _end_value(self, text: str, end: int) -> None:
        self._state = _State.AFTER_VALUE
        if self._token_start == self.args_start:
            self.args_end = end
        if self._key in self.name_keys and self.name is None:
            try:
                name = json.loads(text[self._token_start:end])
            except ValueError:
                name = None
            if not isinstance(name, str) or not name:
                self._state = _State.FAILED
                return
            self.name = name

    @property
    def arguments_so_far(self) -> str:
        """The arguments' raw text generated so far ("" before they start)."""
        if self.args_start is None:
            return ""
        return self.text[self.args_start:self.args_end if self.args_end is not None else len(self.text)]

    @property
    def can_commit(self) -> bool:
        """Name known and the arguments started as an object: surely a call, worth streaming before it closes."""
        return self.name is not None and self.args_start is not None and self.text[self.args_start] == "{"

    def call(self) -> tuple[str, str] | None:
        """Once ``done``: (name, arguments as JSON text), or None if the object is no valid call."""
        try:
            whole = json.loads(self.text)
            arguments = "{}" if self.args_start is None else self.text[self.args_start:self.args_end]
            value = json.loads(arguments)
            if isinstance(value, str):  # arguments sent as a JSON string of the object
                arguments, value = value, json.loads(value)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(whole, dict) or self.name is None:
            return None
        return self.name, arguments
