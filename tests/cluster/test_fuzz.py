"""Hostile input against the real gRPC gateway, built from the proto: valid, invalid and random field values and raw
garbage bytes, seeded. Each class gets its status (never UNKNOWN or INTERNAL); valid greedy requests interleaved with
the fuzz complete with exactly the offline tokens; afterwards health is SERVING and every KV block is free."""
from __future__ import annotations

import asyncio
import math
import random

import grpc
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.client import AsyncClient
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.proto.v1 import generation_pb2 as pb
from pagedserve.tests.server_thread import ServerThread
from pagedserve.tests.utils import VOCAB

GENERATE = "/pagedserve.v1.GenerationService/Generate"
MAX_MODEL_LEN = 128
SEED = 20261123


@pytest.fixture(scope="module")
def server(ray_cluster, llama_dir):
    srv = ServerThread(EngineArgs(model=llama_dir, seed=0, max_model_len=MAX_MODEL_LEN)).start()
    yield srv
    srv.stop()


def _request(**fields) -> pb.GenerateRequest:
    prompt = fields.pop("prompt", "def fuzz")
    req = pb.GenerateRequest(**{k: v for k, v in fields.items() if k in ("stream_mode", "cache_salt", "priority")})
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt is not None:
        req.token_ids.ids.extend(prompt)
    if "beam" in fields:
        req.beam_search.CopyFrom(fields["beam"])
    if "sampling" in fields:
        req.sampling_params.CopyFrom(fields["sampling"])
    return req


def _invalid(rng: random.Random) -> tuple[str, bytes]:
    """A request each of whose variants breaks one rule; (what, serialized bytes)."""
    sp = pb.SamplingParams
    cases = [
        ("temperature NaN", _request(sampling=sp(temperature=math.nan))),
        ("temperature inf", _request(sampling=sp(temperature=math.inf))),
        ("top_p NaN", _request(sampling=sp(top_p=math.nan))),
        ("top_p 0", _request(sampling=sp(top_p=0.0))),
        ("min_p 2", _request(sampling=sp(min_p=2.0))),
        ("repetition_penalty NaN", _request(sampling=sp(repetition_penalty=math.nan))),
        ("presence_penalty -inf", _request(sampling=sp(presence_penalty=-math.inf))),
        ("n 0", _request(sampling=sp(n=0))),
        ("huge n", _request(sampling=sp(n=rng.randint(10**6, 2**32 - 1), temperature=1.0))),
        ("huge best_of", _request(sampling=sp(best_of=2**32 - 1, temperature=1.0))),
        ("best_of < n", _request(sampling=sp(n=3, best_of=2, temperature=1.0))),
        ("huge logprobs", _request(sampling=sp(logprobs=rng.randint(21, 2**32 - 1)))),
        ("huge prompt_logprobs", _request(sampling=sp(prompt_logprobs=10**6))),
        ("max_tokens over the context", _request(sampling=sp(max_tokens=rng.randint(MAX_MODEL_LEN, 2**32 - 1)))),
        ("min_tokens > max_tokens", _request(sampling=sp(max_tokens=4, min_tokens=9))),
        ("empty stop string", _request(sampling=sp(stop=[""]))),
        ("stop token id out of vocab", _request(sampling=sp(stop_token_ids=[VOCAB + rng.randint(0, 10**6)]))),
        ("token id out of vocab", _request(prompt=[5, VOCAB + rng.randint(0, 2**31)])),
        ("empty prompt", _request(prompt="")),
        ("no prompt", _request(prompt=None)),
        ("prompt over the context", _request(prompt=[7] * (MAX_MODEL_LEN + rng.randint(0, 1000)))),
        ("prompt over the byte limit", _request(prompt="x" * (64 * MAX_MODEL_LEN + 1))),
        ("unknown stream_mode", _request(stream_mode=rng.randint(3, 1000))),
        ("unknown early_stopping", _request(beam=pb.BeamSearchParams(beam_width=2, max_tokens=4,
                                                                     early_stopping=rng.randint(4, 1000)),
                                            stream_mode=pb.STREAM_MODE_FINAL)),
        ("beam_width 0", _request(beam=pb.BeamSearchParams(beam_width=0, max_tokens=4),
                                  stream_mode=pb.STREAM_MODE_FINAL)),
        ("huge beam_width", _request(beam=pb.BeamSearchParams(beam_width=2**31, max_tokens=4),
                                     stream_mode=pb.STREAM_MODE_FINAL)),
        ("length_penalty NaN", _request(beam=pb.BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=math.nan),
                                        stream_mode=pb.STREAM_MODE_FINAL)),
        ("length_penalty inf", _request(beam=pb.BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=math.inf),
                                        stream_mode=pb.STREAM_MODE_FINAL)),
        ("beam and sampling", _request(beam=pb.BeamSearchParams(beam_width=2, max_tokens=4), sampling=sp(n=1))),
        ("priority under fcfs", _request(priority=rng.choice([-(2**31), -1, 1, 2**31 - 1]))),
    ]
    what, req = rng.choice(cases)
    return what, req.SerializeToString()


def _garbage(rng: random.Random) -> tuple[str, bytes]:
    """Bytes that are no well-formed GenerateRequest (truncated varints, bad wire types, random noise)."""
    kind = rng.randrange(3)
    if kind == 0:
        return "random bytes", bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    if kind == 1:
        valid = _request(sampling=pb.SamplingParams(max_tokens=4)).SerializeToString()
        return "truncated message", valid[: rng.randint(1, len(valid) - 1)]
    return "field 2 with wire type 7", b"\x17" + bytes(rng.randrange(256) for _ in range(8))


def _random_valid(rng: random.Random) -> pb.GenerateRequest:
    """Random but valid sampling values (seeded, so the outcome is reproducible)."""
    sp = pb.SamplingParams(temperature=rng.choice([0.0, 0.5, 1.0, 1.7]), top_p=rng.uniform(0.05, 1.0),
                           top_k=rng.choice([-1, 0, 1, 5, 50]), min_p=rng.uniform(0, 0.5),
                           repetition_penalty=rng.uniform(0.5, 2.0), presence_penalty=rng.uniform(-2, 2),
                           frequency_penalty=rng.uniform(-2, 2), seed=rng.randrange(2**64),
                           max_tokens=rng.randint(1, 12), logprobs=rng.randint(0, 20))
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] if rng.random() < 0.5 else "fuzz me"
    return _request(prompt=prompt, sampling=sp, cache_salt=rng.choice(["", "a", "b"]))


async def _raw_call(channel: grpc.aio.Channel, payload: bytes) -> tuple[grpc.StatusCode, int]:
    """Generate with an identity serializer: the bytes go out as they are; (status, responses received)."""
    call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)(payload, timeout=60)
    n = 0
    try:
        async for _ in call:
            n += 1
    except grpc.aio.AioRpcError as e:
        return e.code(), n
    return grpc.StatusCode.OK, n


def test_fuzz_statuses_and_interleaved_requests_stay_exact(server, llama_dir):
    rng = random.Random(SEED)
    greedy_prompts = [f"def f{i}(x):" for i in range(8)]
    offline = LLM(llama_dir, seed=0, max_model_len=MAX_MODEL_LEN)
    expected = [o.outputs[0].token_ids for o in offline.generate(
        greedy_prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)]
    cases = ([("invalid", *_invalid(rng)) for _ in range(120)] + [("garbage", *_garbage(rng)) for _ in range(60)]
             + [("random valid", "random valid", _random_valid(rng).SerializeToString()) for _ in range(40)])
    rng.shuffle(cases)

    async def run():
        async with AsyncClient(server.target) as client:
            fuzz = asyncio.gather(*[_raw_call(client.channel, payload) for _, _, payload in cases])
            good = asyncio.gather(*[client.generate(p, max_tokens=10, temperature=0.0, ignore_eos=True)
                                    for p in greedy_prompts])
            return await fuzz, await good

    statuses, good = asyncio.run(run())
    for (cls, what, _), (code, n) in zip(cases, statuses):
        if cls == "invalid":
            assert code == grpc.StatusCode.INVALID_ARGUMENT and n == 0, (what, code)
        elif cls == "garbage":  # noise can happen to parse; it must then still be refused or served, cleanly
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OK), (what, code)
        else:
            assert code == grpc.StatusCode.OK and n >= 1, (what, code)
    assert sum(cls == "garbage" and code == grpc.StatusCode.INVALID_ARGUMENT
               for (cls, _, _), (code, _) in zip(cases, statuses)) >= 40
    assert [r.completions[0].token_ids for r in good] == expected
    with server.client(timeout=10) as c:
        assert c.health() == "SERVING"
        info = c.model_info()
        assert info.num_running_requests == 0 and info.num_waiting_requests == 0
        assert info.num_free_kv_blocks == info.num_kv_blocks


def test_invalid_requests_name_the_field(server):
    checks = [
        (_request(sampling=pb.SamplingParams(temperature=math.nan)), "temperature"),
        (_request(sampling=pb.SamplingParams(n=10**6, temperature=1.0)), "max_num_seqs"),
        (_request(sampling=pb.SamplingParams(logprobs=21)), "max_logprobs"),
        (_request(stream_mode=9), "stream_mode"),
        (_request(beam=pb.BeamSearchParams(beam_width=2, max_tokens=4, early_stopping=9),
                  stream_mode=pb.STREAM_MODE_FINAL), "early_stopping"),
        (_request(prompt="y" * (64 * MAX_MODEL_LEN + 1)), "max_prompt_bytes"),
    ]

    async def run():
        async with AsyncClient(server.target) as client:
            out = []
            for req, field in checks:
                call = client.channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call(req.SerializeToString(), timeout=30):
                        pass
                out.append((err.value.code(), err.value.details(), field))
            call = client.channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call(b"\xff\xff\xff", timeout=30):
                    pass
            out.append((err.value.code(), err.value.details(), "GenerateRequest"))
            return out

    for code, details, field in asyncio.run(run()):
        assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details, (field, code, details)
