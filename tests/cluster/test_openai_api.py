"""The OpenAI-compatible HTTP API over loopback, driven by the real ``openai`` SDK (strict response validation):
completions and chat, sync, async and streamed, equal token for token to the offline engine and to the gRPC API;
logprobs and echo; errors as the SDK's exception classes; a client that goes away aborts its request at once."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time

import grpc
import httpx2
import openai
import pytest
from openai._models import validate_type
from openai.types import Completion

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.client import AsyncClient
from pagedserve.common.config import default_model_dir
from pagedserve.common.sampling_params import StructuredOutputsParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.tests.server_thread import ServerThread, free_port, start_in_background
from pagedserve.tests.utils import random_prompts

MODEL = "tiny-llama"
TEMPLATE = f"{default_model_dir()}/chat_template.jinja"  # the demo model's: "# role:\ncontent\n" per message


@pytest.fixture(scope="module")
def server(ray_cluster, llama_dir):
    # A short grammar compile timeout: a schema of thousands of ranged integers (seconds to compile) outlasts it,
    # the few-property ones of the other tests compile in milliseconds.
    srv = ServerThread(EngineArgs(model=llama_dir, seed=0, structured_outputs_compile_timeout=0.5),
                       http_port=free_port(), served_model_name=MODEL, chat_template=TEMPLATE,
                       enable_prompt_tokens_details=True).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(llama_dir, seed=0)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60,
                       _strict_response_validation=True) as c:
        yield c


def _async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60,
                              _strict_response_validation=True)


def _chat_prompt(messages: list[dict]) -> str:
    return "".join(f"# {m['role']}:\n{m['content']}\n" for m in messages) + "# assistant:\n"


def _metric(server, name: str, **labels) -> float:
    text = httpx2.get(f"{server.http_url}/metrics").text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in want))


def _wait_idle(server, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    with server.client() as c:
        while True:
            info = c.model_info()
            if info.num_running_requests == 0 and info.num_waiting_requests == 0 and info.kv_cache_usage == 0.0:
                return info
            assert time.monotonic() < deadline, f"KV blocks not freed: {info}"
            time.sleep(0.02)


CASES = [
    ("def paged(block", dict(temperature=0.0, max_tokens=16)),
    ("import os", dict(temperature=0.0, max_tokens=12, stop=["e"], extra_body={"include_stop_str_in_output": True})),
    ("class Cache:", dict(temperature=0.8, top_p=0.9, seed=7, max_tokens=20)),
    ("return self", dict(temperature=1.0, n=3, seed=11, max_tokens=10, extra_body={"top_k": 20})),
    ("the value of", dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, seed=3, max_tokens=14,
                          extra_body={"repetition_penalty": 1.3, "min_tokens": 4, "min_p": 0.05})),
]


def _offline_params(kw: dict) -> SamplingParams:
    kw = dict(kw)
    kw.update(kw.pop("extra_body", {}))
    return SamplingParams(**kw)


def test_completions_equal_offline(client, offline):
    for prompt, kw in CASES:
        got = client.completions.create(model=MODEL, prompt=prompt, **{**kw, "extra_body": {
            **kw.get("extra_body", {}), "return_token_ids": True}})
        exp = offline.generate(prompt, _offline_params(kw), use_tqdm=False)[0]
        assert got.object == "text_completion" and got.id.startswith("cmpl-") and got.model == MODEL
        assert [c.index for c in got.choices] == list(range(kw.get("n", 1)))
        for c, e in zip(got.choices, exp.outputs):
            assert c.token_ids == e.token_ids, (prompt, kw)
            assert c.text == e.text
            assert c.finish_reason == e.finish_reason and c.stop_reason == e.stop_reason
        assert got.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert got.usage.completion_tokens == sum(len(e.token_ids) for e in exp.outputs)
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    # A stop string taken from the middle of the greedy text: finish "stop", the string as stop_reason.
    full = offline.generate("import os", SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    text = full.outputs[0].text
    stop_str = text[len(text) // 2: len(text) // 2 + 2]
    got = client.completions.create(model=MODEL, prompt="import os", temperature=0.0, max_tokens=12, stop=[stop_str])
    assert got.choices[0].finish_reason == "stop" and got.choices[0].stop_reason == stop_str  # type: ignore
    assert got.choices[0].text == text[:text.index(stop_str)]


def test_seeded_sampling_reproducible_and_batched_prompts(client, offline):
    kw = dict(model=MODEL, temperature=1.0, max_tokens=12, n=2, seed=1234)
    a = client.completions.create(prompt="def fib(n):", **kw)
    b = client.completions.create(prompt="def fib(n):", **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text
    other = client.completions.create(prompt="def fib(n):", **{**kw, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]
    # A batch: texts and token ids in one request, choices numbered prompt * n + completion.
    ids = random_prompts(1, seed=5)[0]
    batch = client.completions.create(model=MODEL, prompt=["def fib(n):", "class A:"], temperature=1.0,
                                      max_tokens=12, n=2, seed=1234)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices[:2]] == [c.text for c in a.choices]
    exp = offline.generate(["class A:", {"prompt_token_ids": ids}],
                           SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=1234), use_tqdm=False)
    assert [c.text for c in batch.choices[2:]] == [o.text for o in exp[0].outputs]
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=1.0, max_tokens=12, n=2, seed=1234)
    assert [c.text for c in by_ids.choices] == [o.text for o in exp[1].outputs]
    assert batch.usage.prompt_tokens == len(exp[0].prompt_token_ids) + a.usage.prompt_tokens


def test_logprobs_and_echo_equal_offline(server, client, offline):
    prompt = "def paged(block): return"
    got = client.completions.create(model=MODEL, prompt=prompt, temperature=0.0, max_tokens=8, logprobs=3)
    exp = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=3),
                           use_tqdm=False)[0]
    out = exp.outputs[0]
    lp = got.choices[0].logprobs
    assert lp.tokens == [e[t].decoded_token for t, e in zip(out.token_ids, out.logprobs)]
    for g, e, tok in zip(lp.token_logprobs, out.logprobs, out.token_ids):
        assert abs(g - e[tok].logprob) < 1e-5
    for top, e, tok in zip(lp.top_logprobs, out.logprobs, out.token_ids):
        want = {lp.decoded_token for t, lp in e.items() if lp.rank <= 3 or t == tok}
        assert set(top) == want  # keys are token texts: byte tokens may share "\ufffd"
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # echo: the prompt's text and logprobs first (the first token's null), as lm-eval's loglikelihood reads them.
    # The SDK's generated types do not allow those nulls (OpenAI's legacy API sends them), so this one is raw JSON.
    r = httpx2.post(f"{server.http_url}/v1/completions", json={
        "model": MODEL, "prompt": prompt, "temperature": 0.0, "max_tokens": 1, "logprobs": 1, "echo": True})
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    n = len(exp.prompt_token_ids)
    assert choice["text"] == prompt + out.text[:len(choice["text"]) - len(prompt)]
    assert choice["logprobs"]["token_logprobs"][0] is None and choice["logprobs"]["top_logprobs"][0] is None
    assert len(choice["logprobs"]["tokens"]) == n + 1
    for g, e, tok in zip(choice["logprobs"]["token_logprobs"][1:n], exp.prompt_logprobs[1:], exp.prompt_token_ids[1:]):
        assert abs(g - e[tok].logprob) < 1e-5
    # vLLM's prompt_logprobs: every prompt position's top tokens by id.
    plp = client.completions.create(model=MODEL, prompt=prompt, temperature=0.0, max_tokens=1,
                                    extra_body={"prompt_logprobs": 2})
    entries = plp.choices[0].prompt_logprobs  # type: ignore[attr-defined]
    assert entries[0] is None and len(entries) == n
    for got_e, e, tok in zip(entries[1:], exp.prompt_logprobs[1:], exp.prompt_token_ids[1:]):
        assert abs(got_e[str(tok)]["logprob"] - e[tok].logprob) < 1e-5


def test_streamed_completions_equal_whole(server, client, offline):
    """The SDK's ``Completion`` type requires a finish_reason, which OpenAI's own streams leave null until the last
    chunk: the stream is read by a lenient client, and each chunk is validated against the type here, with the null
    finish_reason allowed."""
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0) as lenient:
        stream = lenient.completions.create(model=MODEL, prompt="class Block:", temperature=0.8, seed=5, n=2,
                                            max_tokens=24, stream=True, stream_options={"include_usage": True})
        chunks = [c.model_dump() for c in stream]
    for chunk in chunks:
        for c in chunk["choices"]:
            validate_type(type_=Completion, value={**chunk, "choices": [{**c, "finish_reason": c["finish_reason"]
                                                                         or "stop"}]})
    texts, reasons = ["", ""], [None, None]
    for chunk in chunks[:-1]:
        assert len(chunk["choices"]) == 1 and chunk["usage"] is None
        c = chunk["choices"][0]
        assert reasons[c["index"]] is None, "a choice went on after its finish_reason"
        texts[c["index"]] += c["text"]
        reasons[c["index"]] = c["finish_reason"]
    exp = offline.generate("class Block:", SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=24),
                           use_tqdm=False)[0]
    assert texts == [o.text for o in exp.outputs] and reasons == [o.finish_reason for o in exp.outputs]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == sum(
        len(o.token_ids) for o in exp.outputs)
    assert len(chunks) > 4  # streamed token by token, not in one piece


def test_stream_interval_sends_fewer_larger_chunks(server, client, offline):
    """A request's stream_interval (vLLM's field): the first token alone, then chunks of that many tokens, and the
    rest at the end; the text is the whole completion's. Below 1 it is a 400 naming the field. (Read leniently:
    the SDK's type wants the finish_reason that streams leave null until the end.)"""
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0) as lenient:
        stream = lenient.completions.create(model=MODEL, prompt="def main():", temperature=0.0, max_tokens=23,
                                            stream=True, extra_body={"stream_interval": 5, "ignore_eos": True,
                                                                     "return_token_ids": True})
        chunks = [c.choices[0] for c in stream]
    sizes = [len(c.token_ids) for c in chunks]  # type: ignore[attr-defined]
    assert sizes == [1, 5, 5, 5, 5, 2], sizes
    exp = offline.generate("def main():", SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert "".join(c.text for c in chunks) == exp.text
    assert [t for c in chunks for t in c.token_ids] == exp.token_ids  # type: ignore[attr-defined]
    assert chunks[-1].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True,
                                  extra_body={"stream_interval": 0})
    assert "stream_interval" in str(err.value)


def test_beam_search_and_streamed_batch_with_echo(server, client, offline):
    from pagedserve import BeamSearchParams

    beams = client.completions.create(model=MODEL, prompt="import self value", max_tokens=10, n=2, temperature=0.0,
                                      extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 0.5,
                                                  "return_token_ids": True})
    exp = offline.beam_search(["import self value"], BeamSearchParams(beam_width=3, max_tokens=10,
                                                                     length_penalty=0.5))[0]
    n_prompt = beams.usage.prompt_tokens
    assert [c.token_ids for c in beams.choices] == [s.tokens[n_prompt:] for s in exp.sequences[:2]]  # type: ignore
    assert [c.text for c in beams.choices] == [s.text for s in exp.sequences[:2]]
    # A batch of two prompts streamed with echo: each choice's first chunk starts with its prompt.
    body = {"model": MODEL, "prompt": ["def fib(n):", "class A:"], "max_tokens": 8, "temperature": 0.0,
            "echo": True, "stream": True}
    texts = ["", ""]
    with httpx2.stream("POST", f"{server.http_url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["text"]
    whole = client.completions.create(model=MODEL, prompt=["def fib(n):", "class A:"], max_tokens=8,
                                      temperature=0.0)
    assert texts == ["def fib(n):" + whole.choices[0].text, "class A:" + whole.choices[1].text]


def test_async_concurrent_equal_offline(server, offline):
    prompts = random_prompts(12, seed=3)

    async def run():
        async with _async_client(server) as c:
            return await asyncio.gather(*[c.completions.create(
                model=MODEL, prompt=p, temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=10 + i,
                extra_body={"return_token_ids": True}) for i, p in enumerate(prompts)])

    got = asyncio.run(run())
    exp = offline.generate([{"prompt_token_ids": p} for p in prompts],
                           [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=10 + i)
                            for i in range(len(prompts))], use_tqdm=False)
    for g, e in zip(got, exp):
        assert g.choices[0].token_ids == e.outputs[0].token_ids  # type: ignore[attr-defined]
        assert g.choices[0].text == e.outputs[0].text


def test_http_and_grpc_agree(server):
    cases = [("def paged(block", dict(temperature=0.0, max_tokens=16)),
             ("import os", dict(temperature=0.9, top_p=0.8, seed=21, n=2, max_tokens=12)),
             (random_prompts(1, seed=9)[0], dict(temperature=0.0, max_tokens=10, stop=["a"]))]

    async def run():
        async with AsyncClient(server.target) as g, _async_client(server) as h:
            grpc_results = await asyncio.gather(*[g.generate(p, **kw) for p, kw in cases])
            http_results = await asyncio.gather(*[h.completions.create(
                model=MODEL, prompt=p, extra_body={"return_token_ids": True}, **kw) for p, kw in cases])
            return grpc_results, http_results

    grpc_results, http_results = asyncio.run(run())
    for g, h in zip(grpc_results, http_results):
        assert [c.token_ids for c in g.completions] == [c.token_ids for c in h.choices]  # type: ignore[attr-defined]
        assert [c.text for c in g.completions] == [c.text for c in h.choices]
        assert [c.finish_reason for c in g.completions] == [c.finish_reason for c in h.choices]
        assert g.prompt_tokens == h.usage.prompt_tokens and g.completion_tokens == h.usage.completion_tokens


def test_chat_equal_offline(client, offline):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": [{"type": "text", "text": "def fib(n):"}, {"type": "text", "text": "x"}]}]
    got = client.chat.completions.create(model=MODEL, messages=messages, temperature=0.0, max_completion_tokens=12,
                                         logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
    rendered = _chat_prompt([messages[0], {"role": "user", "content": "def fib(n):\nx"}])
    exp = offline.generate(rendered, SamplingParams(temperature=0.0, max_tokens=12, logprobs=2), use_tqdm=False)[0]
    out = exp.outputs[0]
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    choice = got.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == out.text
    assert choice.token_ids == out.token_ids  # type: ignore[attr-defined]
    assert choice.finish_reason == out.finish_reason
    assert got.prompt_token_ids == exp.prompt_token_ids  # type: ignore[attr-defined]
    for g, e, tok in zip(choice.logprobs.content, out.logprobs, out.token_ids):
        assert g.token == e[tok].decoded_token and abs(g.logprob - e[tok].logprob) < 1e-5
        assert [t.token for t in g.top_logprobs] == [
            lp.decoded_token for _, lp in sorted(e.items(), key=lambda x: x[1].rank) if lp.rank <= 2]
        assert g.bytes == list(g.token.encode())
    assert got.usage.prompt_tokens == len(exp.prompt_token_ids) and got.usage.completion_tokens == 12
    # The older max_tokens; continue_final_message ends the prompt inside the assistant's message.
    cont = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "def f("}],
        temperature=0.0, max_tokens=6, extra_body={"continue_final_message": True, "add_generation_prompt": False})
    exp = offline.generate("# user:\nx\n# assistant:\ndef f(", SamplingParams(temperature=0.0, max_tokens=6),
                           use_tqdm=False)[0]
    assert cont.choices[0].message.content == exp.outputs[0].text


def test_chat_streaming_strict(server, offline):
    messages = [{"role": "user", "content": "class Parser:"}]

    async def run():
        async with _async_client(server) as c:
            stream = await c.chat.completions.create(model=MODEL, messages=messages, temperature=1.0, seed=8, n=2,
                                                     max_completion_tokens=16, stream=True,
                                                     stream_options={"include_usage": True})
            return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    exp = offline.generate(_chat_prompt(messages), SamplingParams(temperature=1.0, seed=8, n=2, max_tokens=16),
                           use_tqdm=False)[0]
    first_seen: dict[int, object] = {}
    texts = ["", ""]
    for chunk in chunks[:-1]:
        assert chunk.object == "chat.completion.chunk" and len(chunk.choices) == 1
        c = chunk.choices[0]
        first_seen.setdefault(c.index, c)
        texts[c.index] += c.delta.content or ""
    assert all(first_seen[i].delta.role == "assistant" for i in (0, 1))
    assert texts == [o.text for o in exp.outputs]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32
    assert chunks[-1].usage.prompt_tokens == len(exp.prompt_token_ids)


def test_prefix_cache_hits_show_in_usage(client):
    prompt = random_prompts(1, seed=77, min_len=120, max_len=120)[0]
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 112  # every full 16-token block of the prompt


@pytest.mark.parametrize("kw, status, param", [
    (dict(prompt="x", max_tokens=100_000), 400, "prompt"),
    (dict(prompt="x", top_p=1.5), 400, "top_p"),  # a validation error: 400, not FastAPI's 422
    (dict(prompt="x", n=0), 400, "n"),
    (dict(prompt="x", temperature=0.0, n=2), 400, "best_of"),
    (dict(prompt="x", logprobs=10_000), 400, "logprobs"),
    (dict(prompt=[5, 100_000]), 400, "prompt"),
    (dict(prompt="", max_tokens=4), 400, "prompt"),
    (dict(prompt="x", stream=True, best_of=3, n=1, temperature=1.0), 400, "best_of"),
    (dict(prompt="x", logit_bias={"5": 10.0}), 400, "logit_bias"),
    (dict(prompt="x", stop=[f"s{i}" for i in range(129)]), 400, "stop"),  # each token is matched against each
    (dict(prompt="x", stop="y" * 1025), 400, "stop"),
    (dict(prompt="x", extra_body={"stop_token_ids": list(range(1025))}), 400, "stop_token_ids"),
    (dict(prompt="x", model="no-such-model"), 404, "model"),
])
def test_errors_arrive_as_sdk_exceptions(server, client, kw, status, param):
    kw = {"model": MODEL, **kw}
    before = _metric(server, "pagedserve_request_errors_total", protocol="http")
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(**kw)
    e = err.value
    assert type(e) is {400: openai.BadRequestError, 404: openai.NotFoundError}[status]
    assert e.status_code == status and "Traceback" not in e.message
    assert set(e.body) == {"message", "type", "param", "code"} and e.body["param"] == param
    assert _metric(server, "pagedserve_request_errors_total", protocol="http") == before + 1
    assert client.completions.create(model=MODEL, prompt="class", max_tokens=2).usage.completion_tokens == 2


def test_priority_needs_the_priority_policy_and_no_tenant_header_is_trusted(server, client):
    """Under the default fcfs policy a priority other than 0 (the SDK's extra_body, as vLLM) is the engine's 400. A
    server that names no tenant header ignores one: the request is the default tenant's."""
    chat = [{"role": "user", "content": "x"}]
    for create in (lambda **kw: client.completions.create(prompt="class", **kw),
                   lambda **kw: client.chat.completions.create(messages=chat, **kw)):
        with pytest.raises(openai.BadRequestError) as err:
            create(model=MODEL, max_tokens=2, extra_body={"priority": -1})
        assert err.value.body["param"] == "priority"
        assert err.value.body["message"] == "priority -1 needs --scheduling-policy priority; this engine schedules fcfs"
        assert create(model=MODEL, max_tokens=2, extra_body={"priority": 0}).usage.completion_tokens == 2
    before = _metric(server, "pagedserve_tenant_requests_total", tenant="default")
    r = httpx2.post(f"{server.http_url}/v1/completions", json={"prompt": "class", "max_tokens": 2},
                    headers={"x-tenant-id": "team-a"})
    assert r.status_code == 200
    assert _metric(server, "pagedserve_tenant_requests_total", tenant="default") == before + 1
    assert 'tenant="team-a"' not in httpx2.get(f"{server.http_url}/metrics").text


def test_unknown_fields_are_ignored_and_named_guided_fields_constrain(server, client, offline, caplog):
    """Fields this server does not know (ones clients send everywhere, and nested ones) are ignored as vLLM does:
    the output is what it is without them, a response header names them, each name is logged once. vLLM's older
    guided_* fields constrain as structured_outputs does."""
    exp = offline.generate(["class"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    with caplog.at_level(logging.WARNING, logger="pagedserve.cluster.server.openai.unknown_fields"):
        for _ in range(2):
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt="class", max_tokens=8, temperature=0.0,
                extra_body={"metadata": {"k": "v"}, "store": False, "ignored_once_x": 1})
            ignored = set(raw.headers["x-pagedserve-ignored-fields"].split(", "))
            assert ignored == {"metadata", "store", "ignored_once_x"}
            assert raw.parse().choices[0].text == exp.text
        chat = client.chat.completions.with_raw_response.create(
            model=MODEL, max_completion_tokens=4, temperature=0.0, store=False, reasoning_effort="low",
            parallel_tool_calls=True, messages=[{"role": "user", "content": "x", "ignored_once_y": 1}])
    assert set(chat.headers["x-pagedserve-ignored-fields"].split(", ")) == \
        {"store", "reasoning_effort", "messages.0.ignored_once_y"}  # parallel_tool_calls is known (tool calling)
    assert chat.parse().choices[0].message.content is not None
    once = [r.getMessage() for r in caplog.records if "ignored_once_x" in r.getMessage()]
    assert len(once) == 1 and "--strict-request-fields" in once[0]
    plain = client.completions.with_raw_response.create(model=MODEL, prompt="class", max_tokens=2)
    assert "x-pagedserve-ignored-fields" not in plain.headers

    regex = r"[a-z]{3,8}@[a-z]{2,5}\.com"
    prompt = random_prompts(1, seed=12)[0]
    want = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60,
                                                     structured_outputs=StructuredOutputsParams(regex=regex)),
                            use_tqdm=False)[0].outputs[0]
    guided = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0.0,
                                       extra_body={"guided_regex": regex})
    assert guided.choices[0].text == want.text
    colors = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "color?"}],
                                            max_completion_tokens=8, temperature=1.0, seed=3, n=4,
                                            extra_body={"guided_choice": ["red", "blue"]})
    assert {c.message.content for c in colors.choices} <= {"red", "blue"}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", extra_body={"guided_regex": "a+",
                                                                       "structured_outputs": {"regex": "b+"}})
    assert err.value.body["param"] == "structured_outputs" and "guided_*" in err.value.message


def test_a_batch_counts_each_sequence_against_the_concurrency_limit(ray_cluster, llama_dir):
    """--max-concurrent-requests counts engine sequences: a completions batch of P prompts with n samples takes
    P x n slots (429 while others hold them; 400 when it could never fit)."""
    srv = ServerThread(EngineArgs(model=llama_dir, seed=0), http_port=free_port(), served_model_name=MODEL,
                       max_concurrent_requests=4).start()
    try:
        with openai.OpenAI(base_url=f"{srv.http_url}/v1", api_key="x", max_retries=0) as c:
            two_by_two = dict(model=MODEL, prompt=["a", "b"], n=2, temperature=1.0, max_tokens=2)
            assert len(c.completions.create(**two_by_two).choices) == 4
            with pytest.raises(openai.BadRequestError) as err:
                c.completions.create(**{**two_by_two, "prompt": ["a", "b", "c"]})  # 6 > 4
            assert err.value.body["param"] == "n" and "6 sequences" in err.value.message
            stream = c.completions.create(model=MODEL, prompt="class", max_tokens=200, temperature=0.0,
                                          stream=True, extra_body={"ignore_eos": True})
            next(iter(stream))  # one sequence running: 1 + 4 > 4
            with pytest.raises(openai.RateLimitError):
                c.completions.create(**two_by_two)
            stream.close()
    finally:
        srv.stop()


def test_oversized_chat_fields_are_400_at_once_while_streams_flow(server, client):
    """A 1 MB role (or name, or chat_template_kwargs) is refused in about the time it takes to read, and a stream
    running meanwhile never stalls (a larger body is refused before it is read: test_gateway_limits)."""
    gaps, done = [], threading.Event()
    body = dict(model=MODEL, prompt="class", max_tokens=200, temperature=0.0, stream=True, ignore_eos=True)

    def stream() -> None:
        last = time.monotonic()
        with httpx2.Client(timeout=60) as c, c.stream("POST", f"{server.http_url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
        done.set()

    t = start_in_background(stream, until=lambda: bool(gaps))
    for msg, extra, param in [({"role": "u" * 1_000_000, "content": "x"}, {}, "messages.0.role"),
                              ({"role": "user", "content": "x", "name": "n" * 10_000}, {}, "messages.0.name"),
                              ({"role": "user", "content": "x"}, {"chat_template_kwargs": {"k": "v" * 70_000}},
                               "chat_template_kwargs")]:
        t0 = time.monotonic()
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=[msg], max_completion_tokens=2, extra_body=extra)
        assert err.value.body["param"] == param and time.monotonic() - t0 < 5
    r = httpx2.post(f"{server.http_url}/detokenize", json={"tokens": [5] * 100_000}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens" and "max_model_len" in r.text
    t.join(60)
    assert done.is_set() and len(gaps) >= 100 and max(gaps[1:]) < 1.0, max(gaps[1:])


def test_tools_are_refused_not_ignored(client):
    """tool_choice "auto" (the default with tools) on a server without --enable-auto-tool-choice gets a 400 that
    says so, never a silent answer without calls; tool_choice none chats as usual (tests/cluster/test_tool_calling.py
    has the rest)."""
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "time?"}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_completion_tokens=2)
    assert err.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in err.value.message
    ok = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="none",
                                        max_completion_tokens=2)
    assert ok.choices[0].message.content is not None and not ok.choices[0].message.tool_calls


def test_chat_errors(client):
    for kw, param in [(dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
                       "messages.0.content"),
                      (dict(messages=[{"role": "user", "content": "x"}], logprobs=False, top_logprobs=2),
                       "top_logprobs"),
                      (dict(messages=[{"role": "user", "content": "x"}],
                            extra_body={"add_generation_prompt": True, "continue_final_message": True}),
                       "continue_final_message")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, **kw)
        assert (err.value.body["param"] or "").startswith(param), err.value.body


def test_client_disconnect_aborts_at_once(server):
    """A stream dropped after two events, and a whole-response request whose client times out: each is aborted
    at once, every KV block free, long before the 8 x 250 tokens it asked for (~2000 scheduled tokens)."""
    long = {"model": MODEL, "prompt": "x", "max_tokens": 250, "n": 8, "temperature": 1.0, "seed": 1,
            "ignore_eos": True}
    aborted = _metric(server, "pagedserve_requests_finished_total", protocol="http", finish_reason="abort")
    scheduled = _metric(server, "pagedserve_scheduled_tokens_total")
    with httpx2.Client(base_url=server.http_url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 2:
                    break
    _wait_idle(server)
    assert _metric(server, "pagedserve_scheduled_tokens_total") - scheduled < 1000
    assert _metric(server, "pagedserve_requests_finished_total", protocol="http", finish_reason="abort") == aborted + 1
    scheduled = _metric(server, "pagedserve_scheduled_tokens_total")
    with pytest.raises(httpx2.TimeoutException):
        httpx2.post(f"{server.http_url}/v1/completions", json=long, timeout=0.15)
    _wait_idle(server)
    assert _metric(server, "pagedserve_scheduled_tokens_total") - scheduled < 1000


def test_models_tokenize_health_version_metrics(server, client, offline):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].owned_by == "pagedserve"
    tok = offline.get_tokenizer()
    text = "def paged(block): return cache"
    with httpx2.Client(base_url=server.http_url) as c:
        r = c.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
        assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
        assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
        assert c.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}
        bad = c.post("/detokenize", json={"tokens": [10**6]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert c.get("/health").status_code == 200
        assert c.get("/version").json()["version"]
        unknown = c.get("/v1/nothing-here")
        assert unknown.status_code == 404 and "error" in unknown.json()
        spec = c.get("/openapi.json").json()
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
                     "/detokenize", "/version"):
            assert path in spec["paths"], path
        assert "400" in spec["paths"]["/v1/completions"]["post"]["responses"]
        assert not [p for p, ops in spec["paths"].items() for op in ops.values() if "422" in op["responses"]]
        metrics = c.get("/metrics").text
    assert 'pagedserve_requests_finished_total{finish_reason="length",model_name="tiny-llama",protocol="http"}' \
        in metrics
    assert json.loads(json.dumps(spec))  # the spec is plain JSON


def test_metrics_count_each_protocol(server, client):
    def snapshot() -> list[float]:
        return [_metric(server, "pagedserve_requests_finished_total", protocol=p, finish_reason="length")
                for p in ("http", "grpc")] + [_metric(server, "pagedserve_time_to_first_token_seconds_count",
                                                      protocol="http"),
                                              _metric(server, "pagedserve_prompt_tokens_total", protocol="http")]

    before = snapshot()
    client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3)
    with server.client() as g:
        g.generate("x", max_tokens=3)
    after = snapshot()
    assert after[0] == before[0] + 2 and after[1] == before[1] + 1 and after[2] == before[2] + 2
    assert after[3] > before[3] + 3


def test_a_grammar_that_does_not_compile_in_time_is_a_400(server, client):
    """The compile runs off the engine loop and past its timeout ends only its own request, as the request's fault."""
    n = 8000
    schema = {"type": "object", "required": [f"p{i}" for i in range(n)],
              "properties": {f"p{i}": {"type": "integer", "minimum": i, "maximum": 10 * i + 7} for i in range(n)}}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"json": schema}})
    assert "did not compile within" in err.value.message, err.value.message
    assert client.completions.create(model=MODEL, prompt="class", max_tokens=3).usage.completion_tokens == 3


def test_structured_outputs_over_http_and_grpc(server, client, offline):
    """response_format and structured_outputs (HTTP) and the proto's oneof (gRPC) constrain exactly as offline."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "c": {"enum": ["red", "blue"]}},
              "required": ["n", "c"], "additionalProperties": False}
    regex = r"[a-z]{3,8}@[a-z]{2,5}\.com"
    prompt = random_prompts(1, seed=12)[0]
    want = {k: offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so),
                                use_tqdm=False)[0].outputs[0]
            for k, so in [("json", StructuredOutputsParams(json=schema)),
                          ("compact", StructuredOutputsParams(json=schema, disable_any_whitespace=True)),
                          ("regex", StructuredOutputsParams(regex=regex))]}
    assert want["regex"].finish_reason == "stop" and re.fullmatch(regex, want["regex"].text)
    by_format = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=60, temperature=0.0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                    "return_token_ids": True})
    by_vllm = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0.0,
                                        extra_body={"structured_outputs": {"regex": regex}, "return_token_ids": True})
    assert by_format.choices[0].token_ids == list(want["json"].token_ids)  # type: ignore[attr-defined]
    assert by_vllm.choices[0].text == want["regex"].text
    if want["json"].finish_reason == "stop":
        assert set(json.loads(by_format.choices[0].text)) == {"n", "c"}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "color?"}],
                                          max_completion_tokens=8, temperature=1.0, seed=3, n=4,
                                          extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert {c.message.content for c in chat.choices} <= {"red", "blue"}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", extra_body={"structured_outputs": {"regex": "(open"}})
    assert err.value.body["param"] == "structured_outputs" and "regex" in err.value.message

    async def grpc_calls():
        async with AsyncClient(server.target) as g:
            ok = await g.generate(prompt, max_tokens=60, temperature=0.0, structured_outputs={"regex": regex})
            compact = await g.generate(prompt, max_tokens=60, temperature=0.0,
                                       structured_outputs={"json": schema, "disable_any_whitespace": True})
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await g.generate("x", structured_outputs={"json": '{"type": "nope"}'})
            return ok, compact, bad.value

    ok, compact, bad = asyncio.run(grpc_calls())
    assert ok.completions[0].text == want["regex"].text
    assert list(compact.completions[0].token_ids) == list(want["compact"].token_ids)
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "json" in bad.details()
