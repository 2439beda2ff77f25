"""The tool-call parsers (hermes, llama3_json, mistral, and tool_choice's "required" / named outputs): whole-output
parses, and streams of the same text split at every position and in random pieces giving the same calls and content;
text that is no valid call stays content."""
from __future__ import annotations

import json
import random

import pytest

from pagedserve.cluster.server.openai.tool_parsers import TOOL_PARSER_NAMES, TOOL_PARSERS
from pagedserve.cluster.server.openai.tool_parsers.forced import REQUIRED_CALLS, NamedToolParser
from pagedserve.cluster.server.openai.tool_parsers.types import ContentDelta, ParsedOutput, ToolCallDelta, collect

WEATHER = {"city": "Paris", "days": 3, "units": {"t": "C", "list": [1, "}]", {"a": None}]}}
W = json.dumps(WEATHER)

# (parser, output, expected content, expected [(name, arguments)])
VALID = [
    ("hermes", f'<tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>', None, [("get_weather", W)]),
    ("hermes", f'Let me look.\n<tool_call>\n{{"name": "a", "arguments": {{}}}}\n</tool_call>\n'
               f'<tool_call>{{"arguments": {W}, "name": "b"}}</tool_call>\n', "Let me look.\n",
     [("a", "{}"), ("b", W)]),
    ("hermes", '<tool_call>{"name": "now"}</tool_call> and "quotes" <tool_call>', ' and "quotes" <tool_call>',
     [("now", "{}")]),
    ("hermes", 'esc: "\\u00e9 <b>" <tool_call>{"name": "q\\"x", "arguments": {"s": "a\\\\\\"}{"}}</tool_call>',
     'esc: "\\u00e9 <b>" ', [('q"x', '{"s": "a\\\\\\"}{"}')]),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {W}}}', None, [("get_weather", W)]),
    ("llama3_json", f' {{"name": "a", "parameters": {W}}}; {{"name": "b", "arguments": {{"x": 1}}}}', None,
     [("a", W), ("b", '{"x": 1}')]),
    ("mistral", f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {W}}}, {{"name": "b", "arguments": {{}}}}]',
     None, [("get_weather", W), ("b", "{}")]),
    ("mistral", f'Sure [x]. [TOOL_CALLS][{{"name": "a", "arguments": {W}}}]', "Sure [x]. ", [("a", W)]),
    ("required", f' [{{"name": "a", "parameters": {W}}}, {{"parameters": {{"k": true}}, "name": "b"}}]', None,
     [("a", W), ("b", '{"k": true}')]),
]

NOT_CALLS = [
    ("hermes", "no calls here <tool but text"),
    ("hermes", "<tool_call>not json</tool_call>"),
    ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "a", "arguments": [1, 2]}</tool_call>'),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", 'The answer: {"name": "a", "parameters": {}}'),
    ("llama3_json", "<|python_tag|>print(1)"),
    ("mistral", "[TOOL_CALLS] sorry"),
    ("mistral", "plain [TOOL_CALL] text ["),
]


def _parser(name: str, stream: bool):
    if name == "required":
        return REQUIRED_CALLS(stream=stream)
    if name == "named":
        return NamedToolParser("f", stream=stream)
    return TOOL_PARSERS[name](stream=stream)


def _stream(name: str, pieces: list[str]) -> tuple[ParsedOutput, list]:
    parser = _parser(name, stream=True)
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    return collect(events), events


def _calls(parsed: ParsedOutput) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parsed.calls]


def _random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_registry_names():
    assert TOOL_PARSER_NAMES == ["hermes", "llama3_json", "mistral"]
    assert TOOL_PARSERS["mistral"].skip_special_tokens is False
    assert {TOOL_PARSERS[name].finish_reason for name in TOOL_PARSER_NAMES} == {"tool_calls"}
    assert REQUIRED_CALLS.finish_reason == "tool_calls"


@pytest.mark.parametrize("name,text,content,calls", VALID)
def test_whole_output_parse(name, text, content, calls):
    parsed = _parser(name, stream=False).parse(text)
    assert _calls(parsed) == calls
    assert parsed.content == content
    assert len({c.id for c in parsed.calls}) == len(calls)
    for _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)


@pytest.mark.parametrize("name,text,content,calls", VALID)
def test_stream_split_anywhere_gives_the_same_calls(name, text, content, calls):
    rng = random.Random(len(text))
    splits = [[text]] + [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)] + \
        [_random_pieces(text, rng) for _ in range(30)]
    for pieces in splits:
        parsed, events = _stream(name, pieces)
        assert _calls(parsed) == calls, pieces
        assert parsed.content == content, pieces
        heads = [e for e in events if isinstance(e, ToolCallDelta) and e.name is not None]
        assert [h.index for h in heads] == list(range(len(calls)))
        assert all(h.arguments == "" and h.id for h in heads)


def test_stream_announces_a_call_before_it_ends():
    """The name goes out once known, then the arguments as they come (not only at the end)."""
    text = f'Hi <tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>'
    parser = _parser("hermes", stream=True)
    seen: list = []
    for i, ch in enumerate(text):
        seen += parser.feed(ch)
        if i == text.index('"city"'):
            assert [e.name for e in seen if isinstance(e, ToolCallDelta) and e.name] == ["get_weather"]
    fragments = [e.arguments for e in seen if isinstance(e, ToolCallDelta) and e.name is None]
    assert len(fragments) > 10 and "".join(fragments) == W
    assert "".join(e.text for e in seen if isinstance(e, ContentDelta)) == "Hi "


@pytest.mark.parametrize("name,text", NOT_CALLS)
def test_text_that_is_no_call_stays_content(name, text):
    parsed = _parser(name, stream=False).parse(text)
    assert parsed.calls == [] and parsed.content == text
    for pieces in ([text], list(text), [text[:5], text[5:]]):
        streamed, _ = _stream(name, pieces)
        assert streamed.calls == [] and streamed.content == text, pieces


def test_a_broken_call_between_good_ones_stays_content():
    good = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    text = f'{good} <tool_call>oops</tool_call> {good}'
    for parsed in (_parser("hermes", False).parse(text), _stream("hermes", list(text))[0]):
        assert _calls(parsed) == [("a", "{}"), ("a", "{}")]
        assert parsed.content == "<tool_call>oops</tool_call> "


def test_cut_short_call_streams_what_came():
    """Streaming, a call announced before the output was cut short (max_tokens) keeps its partial arguments; the
    whole-output parse leaves it as content."""
    text = '<tool_call>{"name": "a", "arguments": {"city": "Pa'
    streamed, _ = _stream("hermes", [text])
    assert _calls(streamed) == [("a", '{"city": "Pa')]
    assert _parser("hermes", False).parse(text).calls == []


def test_mistral_ids_are_nine_alphanumerics():
    parsed = _parser("mistral", False).parse('[TOOL_CALLS][{"name": "a", "arguments": {}}]')
    assert len(parsed.calls[0].id) == 9 and parsed.calls[0].id.isalnum()


def test_named_function_output_is_its_arguments():
    parsed = _parser("named", False).parse(W)
    assert _calls(parsed) == [("f", W)] and parsed.content is None
    for pieces in ([W], list(W), [W[:7], W[7:]]):
        streamed, events = _stream("named", pieces)
        assert _calls(streamed) == [("f", W)]
        assert events[0] == ToolCallDelta(0, "", events[0].id, "f")
    assert _calls(_stream("named", [])[0]) == [("f", "")]
