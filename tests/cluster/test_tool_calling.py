"""Chat tool calling over loopback HTTP with the real ``openai`` SDK (strict response validation): tool_choice
"required" and a named function constrained by structured output, "auto" refused without the server's flags and
parsed by the hermes parser with them, streamed deltas accumulating to the same calls, a history of calls and tool
results rendered by the chat template, the size limits, and LangChain / LiteLLM as clients."""
from __future__ import annotations

import json
import os

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from transformers import AutoTokenizer

from pagedserve.cluster.server.api_options import ApiOptions
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.tests.server_thread import ServerThread, free_port

MODEL = "tiny-llama"
TEMPLATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                        "tool_chat_template.jinja")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
FORCED = '<tool_call>\\{"name": "get_weather", "arguments": \\{"city": "(Paris|Rome)", "days": [1-7]\\}\\}</tool_call>'


@pytest.fixture(scope="module")
def model_dir(model_factory) -> str:
    return model_factory("llama", max_position_embeddings=1024)  # room for the tools in the prompt


@pytest.fixture(scope="module")
def server(ray_cluster, model_dir):
    srv = ServerThread(EngineArgs(model=model_dir, seed=0), http_port=free_port(), served_model_name=MODEL,
                       chat_template=TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="hermes").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60,
                       _strict_response_validation=True) as c:
        yield c


def _validate(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    try:
        import jsonschema
    except ImportError:
        assert set(args) == set(SCHEMAS[name]["required"])
    else:
        jsonschema.validate(args, SCHEMAS[name])
    return args


def _stream(c: openai.OpenAI, **kw):
    """The streamed chunks accumulated by the SDK, and the chunks' tool-call deltas."""
    state = ChatCompletionStreamState()
    deltas = []
    for chunk in c.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
    return state.get_final_completion(), deltas


def _calls(message) -> list[tuple[str, str]]:
    return [(t.function.name, t.function.arguments) for t in message.tool_calls or []]


def test_named_function(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_completion_tokens=120, temperature=0.0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    _validate("get_weather", call.function.arguments)

    streamed, deltas = _stream(client, **kw)
    assert streamed.choices[0].finish_reason == "stop"
    assert _calls(streamed.choices[0].message) == _calls(choice.message)
    head = deltas[0]
    assert head.index == 0 and head.id and head.type == "function" and head.function.name == "get_weather"
    assert head.function.arguments == "" and len(deltas) >= 2
    assert all(d.id is None and d.function.name is None for d in deltas[1:])


@pytest.mark.parametrize("parallel", [True, False])
def test_required(client, parallel):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
              max_completion_tokens=160, temperature=0.0, seed=1)
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = _calls(choice.message)
    assert calls and (parallel or len(calls) == 1)
    for name, arguments in calls:
        _validate(name, arguments)
    assert len({t.id for t in choice.message.tool_calls}) == len(calls)
    streamed, _ = _stream(client, **kw)
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert _calls(streamed.choices[0].message) == calls


def test_auto_needs_the_server_flags(server, client, monkeypatch):
    """As on a server started without --enable-auto-tool-choice and --tool-call-parser (test_openai_api.py starts
    one): the flags are read per request, from the options the gateway was given."""
    monkeypatch.setattr(server.gateway.state, "options", ApiOptions())
    for extra in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_completion_tokens=2, **extra)
        assert err.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in err.value.message
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                           max_completion_tokens=2)
    assert plain.choices[0].message.content is not None and not plain.choices[0].message.tool_calls


def test_auto_parses_hermes_calls(client):
    """A random model makes no calls of its own: a regex makes it write one, which the hermes parser reads."""
    for prefix, content in [("", None), ("Sure\\. ", "Sure. ")]:
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_completion_tokens=100, temperature=0.0,
                  extra_body={"structured_outputs": {"regex": prefix + FORCED}})
        choice = client.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == content
        [(name, arguments)] = _calls(choice.message)
        assert name == "get_weather" and _validate(name, arguments)["city"] in ("Paris", "Rome")
        streamed, deltas = _stream(client, **kw)
        assert streamed.choices[0].finish_reason == "tool_calls"
        assert _calls(streamed.choices[0].message) == [(name, arguments)]
        assert (streamed.choices[0].message.content or None) == content
        assert deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_completion_tokens=8,
                                                extra_body={"structured_outputs": {"regex": "[a-z ]+"}})
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason in ("stop", "length")


def test_history_of_calls_and_results_renders(client, model_dir):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                       max_completion_tokens=2, extra_body={"return_token_ids": True})
    prompt = AutoTokenizer.from_pretrained(model_dir).decode(r.prompt_token_ids)  # type: ignore[attr-defined]
    assert '# tools:\nget_weather {"type": "object"' in prompt
    assert ('# assistant:\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}'
            '</tool_call>\n# tool call_1:\n18 C and sunny\n# assistant:\n') in prompt


def test_limits_and_refusals(client):
    def call(i: int, arguments: str = "{}") -> dict:
        return {"id": f"c{i}", "type": "function", "function": {"name": "get_time", "arguments": arguments}}

    big_schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                                   for i in range(700)}}
    cases = [
        (dict(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]), "tools"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": big_schema}}]), "tools"),
        (dict(tools=[{"type": "function", "function": {"name": f"f{i}", "description": "d" * 60_000}}
                     for i in range(20)]), "tools"),
        (dict(tools=[{"type": "function", "function": {"name": "f" * 300}}]), "tools.0.function.name"),
        (dict(messages=[{"role": "assistant", "tool_calls": [call(i) for i in range(129)]}]),
         "messages.0.tool_calls"),
        (dict(messages=[{"role": "assistant", "tool_calls": [call(0, '"' + "a" * 70_000 + '"')]}]),
         "messages.0.tool_calls.0.function.arguments"),
        (dict(messages=[{"role": "tool", "tool_call_id": "i" * 300, "content": "x"}]), "messages.0.tool_call_id"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
        (dict(functions=[{"name": "f"}]), "functions"),
    ]
    for kw, param in cases:
        kw.setdefault("messages", ASK)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, max_completion_tokens=2, **kw)
        assert (err.value.body["param"] or "").startswith(param), (param, err.value.body)
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=3)
    assert ok.usage.completion_tokens == 3


def test_langchain_bind_tools(server):
    lc = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    llm = lc.ChatOpenAI(model=MODEL, base_url=f"{server.http_url}/v1", api_key="unused", max_tokens=120,
                        temperature=0.0, max_retries=0)
    message = llm.bind_tools([TOOLS[0]], tool_choice="get_weather").invoke("Weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    _validate("get_weather", json.dumps(call["args"]))
    message = llm.bind_tools(TOOLS, tool_choice="any").invoke("Weather or time?")  # "any" is "required"
    assert message.tool_calls and all(c["name"] in SCHEMAS for c in message.tool_calls)


@pytest.mark.filterwarnings("ignore::UserWarning")  # litellm's own pydantic models
def test_litellm_completion(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of its price list
    litellm = pytest.importorskip("litellm", reason="litellm is not installed")
    r = litellm.completion(model=f"openai/{MODEL}", api_base=f"{server.http_url}/v1", api_key="unused",
                           messages=ASK, tools=TOOLS, max_tokens=120, temperature=0.0,
                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and _validate("get_time", call.function.arguments)
