"""A chat request's tools without a server: what tool_choice constrains the output to (and that the constraint
compiles and takes exactly json.dumps' layout), the refusals, the startup check of the parser flags, and the chat
template rendering tools, an assistant's calls and tool results."""
from __future__ import annotations

import json
import os

import llguidance
import llguidance.hf
import pytest

from pagedserve.cluster.server.api_options import ApiOptions
from pagedserve.cluster.server.openai.chat_protocol import ChatCompletionRequest
from pagedserve.cluster.server.openai.chat_template import ChatTemplate, template_message
from pagedserve.cluster.server.openai.errors import OpenAIError
from pagedserve.cluster.server.openai.tool_calling import check_auto_options, plan_tools
from pagedserve.cluster.server.openai.tool_parsers import TOOL_PARSERS
from pagedserve.cluster.server.openai.tool_parsers.forced import REQUIRED_CALLS, NamedToolParser
from pagedserve.common.config import default_model_dir
from pagedserve.common.sampling_params import StructuredOutputsParams
from pagedserve.engine.tokenizer import load_tokenizer
from pagedserve.scheduler.structured_output import grammar_spec

TEMPLATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                        "tool_chat_template.jinja")
POINT = {"type": "object", "properties": {"p": {"$ref": "#/$defs/xy"}}, "required": ["p"],
         "$defs": {"xy": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
TOOLS = [{"type": "function", "function": {"name": "move", "parameters": POINT}},
         {"type": "function", "function": {"name": "stop"}}]
AUTO = ApiOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")


@pytest.fixture(scope="module")
def demo_tokenizer():
    return load_tokenizer(default_model_dir())


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "go"}], **kw})


def _accepts(tokenizer, schema: dict, text: str) -> bool:
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer),
                                   grammar_spec(StructuredOutputsParams(json=schema)))
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.encode(text, add_special_tokens=False)
    if matcher.validate_tokens(ids) < len(ids):
        return False
    matcher.consume_tokens(ids)
    return matcher.is_accepting()


def test_required_is_a_list_of_calls_in_json_dumps_layout(demo_tokenizer):
    plan = plan_tools(_request(tools=TOOLS, tool_choice="required"), AUTO)
    assert plan.new_parser is REQUIRED_CALLS and plan.tools == TOOLS
    schema = plan.constraint.json
    assert schema["minItems"] == 1 and "maxItems" not in schema and schema["$defs"] == POINT["$defs"]
    good = [{"name": "move", "parameters": {"p": {"x": 1}}}, {"name": "stop", "parameters": {}}]
    assert _accepts(demo_tokenizer, schema, json.dumps(good))
    assert not _accepts(demo_tokenizer, schema, json.dumps(good, indent=1))
    assert not _accepts(demo_tokenizer, schema, json.dumps([{"name": "jump", "parameters": {}}]))
    assert not _accepts(demo_tokenizer, schema, json.dumps([{"name": "move", "parameters": {"p": {}}}]))
    single = plan_tools(_request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), AUTO)
    assert single.constraint.json["maxItems"] == 1
    assert not _accepts(demo_tokenizer, single.constraint.json, json.dumps(good))


def test_named_function_is_its_parameters(demo_tokenizer):
    plan = plan_tools(_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "move"}}), AUTO)
    assert plan.new_parser.func is NamedToolParser and plan.new_parser.args == ("move",)
    assert _accepts(demo_tokenizer, plan.constraint.json, '{"p": {"x": 3}}')
    empty = plan_tools(_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "stop"}}), AUTO)
    assert _accepts(demo_tokenizer, empty.constraint.json, "{}")


def test_auto_none_and_refusals():
    assert plan_tools(_request(tools=TOOLS), AUTO).new_parser is TOOL_PARSERS["hermes"]
    plan = plan_tools(_request(tools=TOOLS, tool_choice="none"), ApiOptions())
    assert plan.tools == TOOLS and plan.constraint is None and plan.new_parser is None
    assert plan_tools(_request(), ApiOptions()).tools is None
    refused = [
        (dict(tools=TOOLS), ApiOptions(), "tool_choice", "--enable-auto-tool-choice"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}), AUTO, "tool_choice",
         "'fly'"),
        (dict(tool_choice="required"), AUTO, "tool_choice", "needs tools"),
        (dict(tools=TOOLS, tool_choice="required", structured_outputs={"regex": "a"}), AUTO, "tool_choice",
         "cannot be combined"),
        (dict(tools=TOOLS, use_beam_search=True), AUTO, "use_beam_search", "beam"),
        (dict(functions=[{"name": "f"}]), AUTO, "functions", "tools"),
        (dict(tools=[{"function": {"name": "a", "parameters": {"$defs": {"d": {"type": "integer"}}}}},
                     {"function": {"name": "b", "parameters": {"$defs": {"d": {"type": "string"}}}}}],
              tool_choice="required"), AUTO, "tools", "$defs"),
    ]
    for kw, options, param, words in refused:
        with pytest.raises(OpenAIError) as err:
            plan_tools(_request(**kw), options)
        assert err.value.status == 400 and err.value.param == param and words in err.value.message, kw


def test_parser_flags_checked_at_startup():
    check_auto_options(AUTO)
    check_auto_options(ApiOptions(tool_call_parser="mistral"))
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        check_auto_options(ApiOptions(enable_auto_tool_choice=True))
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        check_auto_options(ApiOptions(enable_auto_tool_choice=True, tool_call_parser="nope"))


def test_template_renders_tools_calls_and_results(demo_tokenizer):
    with open(TEMPLATE) as f:
        template = ChatTemplate(demo_tokenizer, f.read())
    req = _request(tools=TOOLS, tool_choice="none", messages=[
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "move", "arguments": '{"p": {"x": 1}}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": [{"type": "text", "text": "moved"}]}])
    messages = [template_message(m) for m in req.messages]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"p": {"x": 1}}  # an object, as vLLM passes
    text = template.render(messages, tools=plan_tools(req, ApiOptions()).tools)
    assert text == ("# tools:\nmove " + json.dumps(POINT) + "\nstop {}\n# user:\ngo\n# assistant:\n"
                    '<tool_call>{"name": "move", "arguments": {"p": {"x": 1}}}</tool_call>\n'
                    "# tool call_9:\nmoved\n# assistant:\n")
