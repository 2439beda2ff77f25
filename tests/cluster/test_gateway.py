"""The gRPC gateway over loopback, with real Ray engine-core actors: equality with the offline engine,
cancellation, status codes, health, reflection, abort."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pagedserve import LLM, BeamSearchParams, SamplingParams
from pagedserve.cluster.client import AsyncClient
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.proto.v1 import generation_pb2 as pb
from pagedserve.tests.server_thread import ServerThread
from pagedserve.tests.utils import random_prompts

WORDS = "def class return import self value the of data paged block cache".split()


@pytest.fixture(scope="module")
def server(ray_cluster, llama_dir):
    srv = ServerThread(EngineArgs(model=llama_dir, seed=0)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(llama_dir, seed=0)


def _variant(i: int) -> tuple[str | list[int], dict]:
    """64 requests with mixed parameters; sampled ones carry a seed so they are reproducible."""
    text = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + i % 5))
    seed = 1000 + i
    v = i % 8
    if v == 0:
        return text, dict(temperature=0.0, max_tokens=16)
    if v == 1:
        return text, dict(temperature=0.8, top_p=0.9, seed=seed, max_tokens=20)
    if v == 2:
        return text, dict(temperature=1.0, top_k=20, n=2, seed=seed, max_tokens=12)
    if v == 3:
        return text, dict(temperature=0.0, max_tokens=24, stop=["e", "a "], include_stop_str_in_output=i % 16 == 3)
    if v == 4:
        return text, dict(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2)
    if v == 5:
        return text, dict(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
                          min_tokens=4, seed=seed, max_tokens=16)
    if v == 6:
        return random_prompts(1, seed=i)[0], dict(temperature=0.9, seed=seed, stop_token_ids=[40, 41], max_tokens=16)
    return text, dict(temperature=1.0, n=1, best_of=3, seed=seed, max_tokens=10)


def _offline_prompt(prompt):
    return {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt


def test_64_concurrent_streams_equal_offline(server, offline):
    cases = [_variant(i) for i in range(64)]

    async def run():
        async with AsyncClient(server.target) as c:
            return await asyncio.gather(*[c.generate(p, stream=kw.get("best_of") is None, **kw) for p, kw in cases])

    results = asyncio.run(run())
    expected = offline.generate([_offline_prompt(p) for p, _ in cases], [SamplingParams(**kw) for _, kw in cases],
                                use_tqdm=False)
    for (prompt, kw), got, exp in zip(cases, results, expected):
        assert len(got.completions) == len(exp.outputs) == kw.get("n", 1)
        for g, e in zip(got.completions, exp.outputs):
            assert g.token_ids == e.token_ids, (prompt, kw)
            assert g.text == e.text, (prompt, kw)
            assert g.finish_reason == e.finish_reason
            assert g.stop_reason == e.stop_reason
            if kw.get("logprobs") is not None:
                assert len(g.logprobs) == len(e.logprobs)
                for glp, elp, tok in zip(g.logprobs, e.logprobs, e.token_ids):
                    assert abs(glp.logprob - elp[tok].logprob) < 1e-5 and glp.rank == elp[tok].rank
                    assert [t.token_id for t in glp.top_logprobs] == [
                        t for t, lp in sorted(elp.items(), key=lambda x: x[1].rank) if lp.rank <= 3]
                assert abs(g.cumulative_logprob - e.cumulative_logprob) < 1e-4
        assert got.prompt_tokens == len(exp.prompt_token_ids)
        assert got.completion_tokens == sum(len(e.token_ids) for e in exp.outputs)
        if kw.get("prompt_logprobs") is not None:
            assert len(got.prompt_logprobs) == len(exp.prompt_token_ids) - 1
            for glp, elp, tok in zip(got.prompt_logprobs, exp.prompt_logprobs[1:], exp.prompt_token_ids[1:]):
                assert abs(glp.logprob - elp[tok].logprob) < 1e-5
    assert sum(r.completions[0].finish_reason == "stop" for r, (_, kw) in zip(results, cases) if kw.get("stop")) > 0


def test_beam_search_equals_offline(server, offline):
    params = BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.5)
    with server.client() as c:
        got = c.generate("import self value", stream=False, beam_search=dict(beam_width=3, max_tokens=10,
                                                                             length_penalty=0.5))
    exp = offline.beam_search(["import self value"], params)[0]
    assert [c.token_ids for c in got.completions] == [s.tokens[got.prompt_tokens:] for s in exp.sequences]
    assert [c.text for c in got.completions] == [s.text for s in exp.sequences]
    assert all(abs(c.beam_score - s.score) < 1e-5 for c, s in zip(got.completions, exp.sequences))


def test_chunked_prefill_streams_every_prompt_logprob(ray_cluster, llama_dir, offline):
    """A prompt prefilled in 16-token chunks gets its prompt logprobs over several responses, all of them."""
    prompt = random_prompts(1, seed=7, min_len=60, max_len=60)[0]
    srv = ServerThread(EngineArgs(model=llama_dir, seed=0, max_num_batched_tokens=16)).start()
    try:
        with srv.client() as c:
            responses = list(c.stream(prompt, temperature=0.0, max_tokens=4, prompt_logprobs=2))
    finally:
        srv.stop()
    exp = offline.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=4,
                                                                          prompt_logprobs=2), use_tqdm=False)[0]
    got = [lp for r in responses for lp in r.prompt_logprobs]
    assert sum(1 for r in responses if r.prompt_logprobs) > 1
    assert [g.token_id for g in got] == prompt[1:]
    for g, e, tok in zip(got, exp.prompt_logprobs[1:], prompt[1:]):
        assert abs(g.logprob - e[tok].logprob) < 1e-5 and g.rank == e[tok].rank
        assert [t.token_id for t in g.top_logprobs] == [
            t for t, lp in sorted(e.items(), key=lambda x: x[1].rank) if lp.rank <= 2]
    assert [t for r in responses for c in r.completions for t in c.token_ids] == exp.outputs[0].token_ids


def _wait_idle(client, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = client.model_info()
        if info.num_running_requests == 0 and info.num_waiting_requests == 0 and info.kv_cache_usage == 0.0:
            return info
        time.sleep(0.05)
    raise AssertionError(f"KV blocks not freed: {info}")


def test_cancel_and_deadline_free_blocks(server, offline):
    kw = dict(temperature=0.0, max_tokens=200, ignore_eos=True)
    other_kw = dict(temperature=0.7, seed=5, max_tokens=40)

    async def run():
        async with AsyncClient(server.target) as c:
            other = asyncio.ensure_future(c.generate("the paged block", **other_kw))
            call = c.stream("data cache value", **kw)
            got = 0
            async for resp in call:
                got += len(resp.completions[0].token_ids)
                if got >= 3:
                    break
            call.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                # 200 tokens of the tiny model take ~0.3 s here once the engine is warm: the deadline must cut it
                await c.generate("data cache value", timeout=0.05, **kw)
            return await other, err.value.code()

    other, code = asyncio.run(run())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    exp = offline.generate("the paged block", SamplingParams(**other_kw), use_tqdm=False)[0]
    assert other.completions[0].token_ids == exp.outputs[0].token_ids
    with server.client() as c:
        info = _wait_idle(c)
        assert info.num_free_kv_blocks == info.num_kv_blocks


def test_abort_rpc_ends_the_stream(server):
    async def run():
        async with AsyncClient(server.target) as c:
            call = c.stream("class self", request_id="to-abort", temperature=0.0, max_tokens=200, ignore_eos=True)
            result = []
            async for resp in call:
                result.append(resp)
                if len(result) == 2:
                    assert resp.request_id.startswith("to-abort-")  # the server's id: the client's, suffixed
                    assert not await c.abort("to-abort")
                    assert await c.abort(resp.request_id)
            return result, await c.abort("no-such-request")

    responses, found_missing = asyncio.run(run())
    assert not found_missing
    assert responses[-1].finished and responses[-1].completions[0].finish_reason == pb.FINISH_REASON_ABORT
    with server.client() as c:
        _wait_idle(c)


def test_stream_interval_over_grpc(server, offline):
    """SamplingParams.stream_interval: the first token alone, then a response per 6 tokens, and the rest with the
    end; the same tokens as the offline engine's."""
    with server.client() as c:
        responses = list(c.stream("def value", temperature=0.0, max_tokens=20, ignore_eos=True, stream_interval=6))
    sizes = [len(d.token_ids) for r in responses for d in r.completions]
    assert sizes == [1, 6, 6, 6, 1] and responses[-1].finished, sizes
    want = offline.generate("def value", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert [t for r in responses for d in r.completions for t in d.token_ids] == want.token_ids
    assert "".join(d.text for r in responses for d in r.completions) == want.text


@pytest.mark.parametrize("prompt, kw, field", [
    ("", dict(max_tokens=4), "prompt"),
    ("x", dict(top_p=1.5), "sampling_params.top_p"),
    ("x", dict(temperature=-1.0), "sampling_params.temperature"),
    ("x", dict(n=2, temperature=0.0), "sampling_params.best_of"),
    ("x " * 300, dict(max_tokens=4), "max_model_len"),
    ("x", dict(max_tokens=10_000), "max_tokens"),
    ([5, 100_000], dict(max_tokens=4), "vocabulary"),
    ("x", dict(stop_token_ids=[99_999], max_tokens=4), "stop_token_ids"),
    ("x", dict(best_of=3, n=1, temperature=1.0, stream_mode_delta=True), "stream_mode"),
    ("x", dict(max_tokens=4, priority=1), "priority 1 needs --scheduling-policy priority"),  # fcfs: only 0
])
def test_bad_input_is_invalid_argument(server, prompt, kw, field):
    delta = kw.pop("stream_mode_delta", False)
    with server.client() as c:
        req = pb.GenerateRequest()
        from pagedserve.cluster.client import build_request

        req = build_request(prompt, **kw)
        if delta:
            req.stream_mode = pb.STREAM_MODE_DELTA
        with pytest.raises(grpc.RpcError) as err:
            list(c.stub.Generate(req))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()
        assert "Traceback" not in err.value.details()
        assert c.generate("class", max_tokens=3, temperature=0.0).completion_tokens == 3  # still serving
        _wait_idle(c)


def test_malformed_requests(server):
    with server.client() as c:
        for req in [pb.GenerateRequest(),  # no prompt
                    pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(),
                                       beam_search=pb.BeamSearchParams(beam_width=2, max_tokens=3)),
                    pb.GenerateRequest(text="x", beam_search=pb.BeamSearchParams(beam_width=0, max_tokens=3))]:
            with pytest.raises(grpc.RpcError) as err:
                list(c.stub.Generate(req))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
        # A request id over 256 characters (the server's suffix keeps ids that clients share apart).
        with pytest.raises(grpc.RpcError) as err:
            list(c.stub.Generate(pb.GenerateRequest(request_id="r" * 257, text="y")))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            c.stub.Detokenize(pb.DetokenizeRequest(token_ids=[10**6]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Tokenize and Detokenize take no more than a prompt may hold (max_prompt_bytes, max_model_len).
        for call, req, what in [(c.stub.Tokenize, pb.TokenizeRequest(text="x" * 4_000_000), "max_prompt_bytes"),
                                (c.stub.Detokenize, pb.DetokenizeRequest(token_ids=[5] * 100_000), "max_model_len")]:
            with pytest.raises(grpc.RpcError) as err:
                call(req)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and what in err.value.details()
        _wait_idle(c)


def test_tokenize_detokenize_model_info(server, offline, llama_dir):
    tok = offline.get_tokenizer()
    with server.client() as c:
        ids = c.tokenize("def paged(block): return cache")
        assert ids == tok.encode("def paged(block): return cache")
        assert c.detokenize(ids) == "def paged(block): return cache"
        info = c.model_info()
    cfg = offline.llm_engine.config
    assert info.architecture == "LlamaForCausalLM" and info.max_model_len == cfg.scheduler_config.max_model_len
    assert info.vocab_size == cfg.model_config.vocab_size and info.block_size == 16
    assert info.tensor_parallel_size == 1 and info.data_parallel_size == 1
    assert info.num_kv_blocks > 0 and list(info.eos_token_ids) == cfg.model_config.eos_token_ids


def test_health_and_reflection(server):
    assert server.health_seen[0] == "NOT_SERVING" and server.health_seen[-1] == "SERVING"
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.target) as ch:
        services = ProtoReflectionDescriptorDatabase(ch).get_services()
    assert "pagedserve.v1.GenerationService" in services and "grpc.health.v1.Health" in services
