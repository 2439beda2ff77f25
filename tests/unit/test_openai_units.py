"""The HTTP API's parts that need no server: chat templates (the bundled demo model's, --chat-template, a model
without one), the serve flags, logprobs that JSON cannot carry, an error after a stream began, and the app's
answers before any engine is up (bodies it cannot take, loading); structured-output fields as engine parameters."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math

import pytest

from pagedserve import __version__
from pagedserve.cluster.entrypoints.serve import add_arguments, run
from pagedserve.cluster.entrypoints.serve_options import ServeOptions
from pagedserve.cluster.runtime.ray_auth import unauthenticated_exposure
from pagedserve.cluster.server.api_keys import KeyTable, split_api_keys
from pagedserve.cluster.server.api_options import ApiOptions, exposure_warning
from pagedserve.cluster.server.openai.chat_template import ChatTemplate, load_chat_template
from pagedserve.cluster.server.openai.errors import OpenAIError
from pagedserve.cluster.server.openai.logprobs import CompletionLogprobsBuilder
from pagedserve.cluster.server.openai.protocol import ErrorResponse, VersionResponse
from pagedserve.cluster.server.openai.sse import sse_events
from pagedserve.common.config import default_model_dir
from pagedserve.common.errors import EngineUnavailableError
from pagedserve.common.outputs import Logprob
from pagedserve.engine.tokenizer import load_tokenizer

CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]


@pytest.fixture(scope="module")
def demo_tokenizer():
    return load_tokenizer(default_model_dir())


def test_demo_model_chat_template(demo_tokenizer):
    """The bundled model's tokenizer carries its chat template (chat_template.jinja): chat works out of the box."""
    t = ChatTemplate(demo_tokenizer)
    assert t.template is not None
    assert t.render(CHAT) == "# system:\nYou write Python.\n# user:\ndef fib(n):\n# assistant:\n"
    assert t.render(CHAT, add_generation_prompt=False) == "# system:\nYou write Python.\n# user:\ndef fib(n):\n"
    cont = t.render([*CHAT, {"role": "assistant", "content": "    if n"}], add_generation_prompt=False,
                    continue_final_message=True)
    assert cont.endswith("# assistant:\n    if n")


def test_model_without_template(tokenizer_dir, tmp_path):
    tok = load_tokenizer(tokenizer_dir)
    with pytest.raises(OpenAIError) as err:
        ChatTemplate(tok).render(CHAT)
    assert err.value.status == 400 and "--chat-template" in err.value.message and err.value.param == "messages"
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                    "{% if add_generation_prompt %}<assistant>{% endif %}{{ suffix | default('') }}")
    t = ChatTemplate(tok, load_chat_template(str(path)))
    assert t.render(CHAT) == "<system>You write Python.<user>def fib(n):<assistant>"
    assert t.render(CHAT, kwargs={"suffix": "!"}).endswith("<assistant>!")
    inline = ChatTemplate(tok, load_chat_template("{{ messages[0]['content'] }}"))
    assert inline.render(CHAT) == "You write Python."
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_template_failures_are_400(demo_tokenizer):
    t = ChatTemplate(demo_tokenizer, "{{ raise_exception('only user messages') }}")
    for kw in [dict(), dict(kwargs={"tokenize": True}), dict(continue_final_message=True)]:
        with pytest.raises(OpenAIError) as err:
            t.render(CHAT, **kw)
        assert err.value.status == 400
    with pytest.raises(OpenAIError, match="only user messages"):
        t.render(CHAT)


def test_serve_flags():
    p = argparse.ArgumentParser()
    add_arguments(p)
    ns = p.parse_args([])
    assert ns.http_port == 8000 and ns.grpc_port == 50051 and ns.chat_template is None  # as `vllm serve`
    ns = p.parse_args(["--port", "0", "--grpc-port", "6000", "--chat-template", "t.jinja"])
    assert ns.http_port == 0 and ns.grpc_port == 6000 and ns.chat_template == "t.jinja"
    with pytest.raises(SystemExit):  # gone: --port is the HTTP port now
        p.parse_args(["--http-port", "8000"])
    assert ServeOptions().http_port == 0  # code that builds its own options opts in


def test_serve_takes_the_model_positionally():
    p = argparse.ArgumentParser()
    add_arguments(p)
    ns = p.parse_args(["/models/x", "--kv-cache-memory-bytes", "1000"])
    assert ns.model_tag == "/models/x" and ns.kv_cache_memory == 1000  # vLLM's flag name
    ns = p.parse_args(["/models/x", "--model", "/models/y"])
    with pytest.raises(ValueError, match="two models given"):
        run(ns)


def test_serve_takes_vllms_quantization_and_kv_cache_dtype_flags():
    p = argparse.ArgumentParser()
    add_arguments(p)
    ns = p.parse_args(["/models/x", "--quantization", "int8", "--kv-cache-dtype", "fp8_e5m2"])
    assert ns.quantization == "int8" and ns.kv_cache_dtype == "fp8_e5m2"
    for bad in (["--quantization", "awq"], ["--kv-cache-dtype", "fp4"]):
        with pytest.raises(SystemExit):
            p.parse_args(["/models/x", *bad])


def test_unauthenticated_ray_exposure():
    assert unauthenticated_exposure("10.0.0.5:6379", token_auth=True) is None
    assert unauthenticated_exposure("127.0.0.1:6379", token_auth=False) is None
    assert unauthenticated_exposure("[::1]:6379", token_auth=False) is None
    for exposed in ("10.0.0.5:6379", "ray-head-svc:6379", "[fd00::2]:6379"):
        assert "--allow-unauthenticated-ray" in unauthenticated_exposure(exposed, token_auth=False)


def test_api_keys_from_flags_and_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "from-env")
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).api_key == "from-env"
    keys = tmp_path / "keys"
    keys.write_text("k3\n\n k4 \n")
    ns = p.parse_args(["--api-key", "k1", "--api-key", "k2,", "--api-key-file", str(keys)])
    assert ns.api_key == "k1,k2,k3,k4" and split_api_keys(ns.api_key) == ["k1", "k2", "k3", "k4"]  # env replaced
    (tmp_path / "empty").write_text("\n")
    for bad in (["--api-key-file", str(tmp_path / "empty")], ["--api-key-file", str(tmp_path / "missing")]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    none = KeyTable.build()
    assert exposure_warning("0.0.0.0", none) and exposure_warning("gw.example", KeyTable.build("")) is not None
    assert exposure_warning("127.0.0.1", none) is None and exposure_warning("::1", none) is None
    assert exposure_warning("0.0.0.0", KeyTable.build("k")) is None


def test_logprobs_json_safe():
    entry = {7: Logprob(-math.inf, 2, "a"), 8: Logprob(-0.5, 1, "b")}
    lp = CompletionLogprobsBuilder(1, str).build([7], [entry])
    assert lp.token_logprobs == [-9999.0] and lp.top_logprobs == [{"b": -0.5, "a": -9999.0}]
    json.loads(lp.model_dump_json())  # no -Infinity
    body = OpenAIError(429, "full", headers={"Retry-After": "1"}).body()
    assert ErrorResponse.model_validate_json(body.model_dump_json()).error.type == "rate_limit_error"


def test_a_bug_answers_with_an_error_id_and_logs_the_detail(caplog):
    from pagedserve.cluster.server.openai.errors import from_exception

    with caplog.at_level(logging.ERROR, logger="pagedserve.cluster.server.internal_errors"):
        err = from_exception(KeyError("/srv/models/secret-tenant prompt"))
    assert err.status == 500 and err.code == "internal_error" and "secret" not in err.message
    error_id = err.message.split("(id ", 1)[1].split(")", 1)[0]
    [record] = caplog.records
    assert error_id in record.getMessage() and "secret-tenant" in repr(record.exc_info[1])


def test_error_after_streaming_began_is_one_event_then_done():
    async def chunks():
        yield [VersionResponse(version="1")]
        raise EngineUnavailableError("model replica 0 failed")

    async def collect():
        return [e async for e in sse_events(chunks(), failures.append)]

    failures: list[OpenAIError] = []
    events = asyncio.run(collect())
    assert events[0] == b'data: {"version":"1"}\n\n' and events[-1] == b"data: [DONE]\n\n" and len(events) == 3
    err = json.loads(events[1][len(b"data: "):])["error"]
    assert err["message"] == "model replica 0 failed" and err["type"] == "service_unavailable_error"
    assert [f.grpc_code for f in failures] == ["UNAVAILABLE"]


def test_app_before_the_engine_is_up(demo_tokenizer, monkeypatch):
    from starlette.testclient import TestClient

    from pagedserve.cluster.server.metrics import GatewayMetrics
    from pagedserve.cluster.server.openai import app as app_module
    from pagedserve.cluster.server.state import ServingState

    monkeypatch.setattr(ServingState, "max_body_bytes", property(lambda self: 1000))
    state = ServingState(demo_tokenizer, GatewayMetrics("m"), 10, keys=KeyTable.build("k"))
    c = TestClient(app_module.build_app(state), headers={"Authorization": "Bearer k"})
    json_type = {"content-type": "application/json"}

    def post(body, headers=json_type):
        return c.post("/v1/completions", content=body, headers=headers)

    for body in [b'{"prompt": "x\\ud800"}', b'{"prompt": "x", "temperature": NaN}', b'{"prompt": ']:
        r = post(body)  # lone surrogates (no tokenizer can encode them), NaN, broken JSON
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("the body is not valid JSON"), body
    big = b'{"prompt": "' + b"x" * 2000 + b'"}'
    assert post(big).status_code == 413
    assert post(iter([big[:600], big[600:]])).status_code == 413  # no content-length: counted as it comes
    assert post(b'{"prompt": "x"}').json()["error"]["message"] == "the model is still loading"
    assert post(b'{"prompt": "x"}').status_code == 503
    assert c.get("/health").status_code == 503 and c.get("/v1/models").status_code == 503
    assert c.get("/v1/models", headers={"Authorization": "Bearer no"}).status_code == 401  # the key comes first
    assert c.delete("/v1/completions").status_code == 405 and "error" in c.delete("/v1/completions").json()
    assert c.get("/version").json() == {"version": __version__}
    errors = "".join(line for line in c.get("/metrics").text.splitlines()
                     if line.startswith("pagedserve_request_errors_total") and 'protocol="http"' in line)
    assert 'code="INVALID_ARGUMENT",model_name="m",protocol="http"} 3.0' in errors
    assert 'code="UNAVAILABLE",model_name="m",protocol="http"} 2.0' in errors
    assert 'code="RESOURCE_EXHAUSTED",model_name="m",protocol="http"} 2.0' in errors  # 413, as gRPC counts it


def test_unknown_fields_refused_when_strict(demo_tokenizer):
    from starlette.testclient import TestClient

    from pagedserve.cluster.server.metrics import GatewayMetrics
    from pagedserve.cluster.server.openai import app as app_module
    from pagedserve.cluster.server.state import ServingState

    state = ServingState(demo_tokenizer, GatewayMetrics("m"), 10)
    strict = TestClient(app_module.build_app(state, options=ApiOptions(strict_request_fields=True)))
    r = strict.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x", "foo": 1}],
                                                  "store": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "store"
    assert r.json()["error"]["message"] == \
        "store: Extra inputs are not permitted; messages.0.foo: Extra inputs are not permitted"
    r = strict.post("/tokenize", json={"prompt": "x", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    assert strict.post("/v1/completions", json={"prompt": "x"}).status_code == 503  # known fields: on to the engine
    assert strict.get("/openapi.json").status_code == 200 and strict.get("/docs").status_code == 200
    bare = TestClient(app_module.build_app(state, options=ApiOptions(disable_docs=True)))
    assert [bare.get(p).status_code for p in ("/openapi.json", "/docs", "/redoc")] == [404, 404, 404]


def test_structured_outputs_and_response_format_reach_sampling_params():
    from pagedserve.cluster.server.openai.chat_protocol import ChatCompletionRequest
    from pagedserve.cluster.server.openai.completion_protocol import CompletionRequest
    from pagedserve.cluster.server.openai.sampling import build_params

    def params(cls, **kw):
        return build_params(cls.model_validate(kw), 8, None)

    so = params(CompletionRequest, prompt="x", structured_outputs={"choice": ["yes", "no"]}).structured_outputs
    assert so.choice == ["yes", "no"] and so.kind == "choice"
    so = params(CompletionRequest, prompt="x", structured_outputs={"json": {"type": "object"}}).structured_outputs
    assert so.json == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    so = params(ChatCompletionRequest, messages=[], response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}).structured_outputs
    assert so.json == schema
    assert params(ChatCompletionRequest, messages=[], response_format={"type": "json_object"}).structured_outputs \
        .json_object is True
    assert params(ChatCompletionRequest, messages=[], response_format={"type": "text"}).structured_outputs is None
    for cls, kw, param in [
            (CompletionRequest, dict(prompt="x", structured_outputs={}), "structured_outputs"),
            (CompletionRequest, dict(prompt="x", structured_outputs={"regex": "a", "choice": ["a"]}),
             "structured_outputs"),
            (ChatCompletionRequest, dict(messages=[], response_format={"type": "json_schema"}), "response_format"),
            (CompletionRequest, dict(prompt="x", structured_outputs={"regex": "a"},
                                     response_format={"type": "json_object"}), "response_format"),
            (CompletionRequest, dict(prompt="x", use_beam_search=True, structured_outputs={"regex": "a"}),
             "use_beam_search")]:
        with pytest.raises(OpenAIError) as err:
            params(cls, **kw)
        assert err.value.status == 400 and err.value.param == param, kw
