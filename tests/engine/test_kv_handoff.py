"""A KV handoff between two engines, in process: the prefill engine ends a ``do_remote_decode`` request after its
first token and holds its prompt's blocks; the decode engine pulls them into its prefix cache and resumes the
request there. Greedy and seeded outputs equal one engine's; a block corrupted on the way is refused and
recomputed; leases end on release and on expiry, leaving every block free."""
from __future__ import annotations

import dataclasses
import time

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.core_types import EngineCoreRequest, ResumedCompletion, ResumeState
from pagedserve.scheduler.block_manager import prompt_block_hashes
from pagedserve.tests.utils import random_prompts

BLOCK = 8


def _engine(model_dir: str, **kw) -> LLM:
    return LLM(model_dir, dtype="float32", block_size=BLOCK, enable_prefix_caching=True, max_num_seqs=4,
               max_num_batched_tokens=256, **kw)


def _run(core, request: EngineCoreRequest) -> tuple[list[int], float, list[str], int]:
    """Step until the request ends: its tokens, cumulative logprob, finish reasons and cached prompt tokens."""
    req = core.add_request(request)
    tokens, reasons, cached, logprob = [], [], 0, 0.0
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids.get(0, [])
            logprob = out.cumulative_logprobs.get(0, logprob)
            cached = max(cached, out.num_cached_tokens)
            reasons += [r for r, _ in out.finish_reasons.values()]
    return tokens, logprob, reasons, req.seed


def _request(llm: LLM, rid: str, prompt: list[int], params: SamplingParams, **kw) -> EngineCoreRequest:
    """As the gateway's input processor makes it (EOS among the stop tokens)."""
    _, request = llm.llm_engine.input_processor.process(rid, {"prompt_token_ids": prompt}, params)
    return dataclasses.replace(request, **kw)


def _handoff(prefill: LLM, decode: LLM, prompt: list[int], params: SamplingParams, rid: str, corrupt: bool = False):
    """Prefill on one engine, pull, resume on the other; the whole output and the decode side's pull counts."""
    first, logprob, reasons, seed = _run(prefill.llm_engine.core,
                                         _request(prefill, rid, prompt, params, do_remote_decode=True))
    if reasons != ["remote_decode"]:
        return first, 0, 0  # ended at its first token
    d_llm, prefill, decode = decode, prefill.llm_engine.core, decode.llm_engine.core
    hashes = prompt_block_hashes(prompt + first, BLOCK, None)
    have = decode.num_cached_blocks(hashes)
    handoff = prefill.export_kv(hashes[have:])
    if corrupt:
        handoff.ranks[0].k[0, 1].view(-1)[0] += 1.0  # the second block's first value, on the wire
    inserted = decode.import_kv(handoff, hashes[have - 1] if have else None)
    assert prefill.release_kv(rid)
    resume = ResumeState(seed, [ResumedCompletion(0, first, logprob)])
    rest, _, _, _ = _run(decode, _request(d_llm, rid, prompt, params, resume=resume))
    return first + rest, handoff.num_blocks, inserted


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_greedy_and_seeded_outputs_equal_one_engines(arch, model_factory):
    model_dir = model_factory(arch)
    ref, p, d = _engine(model_dir), _engine(model_dir), _engine(model_dir)
    total = 0
    for i, prompt in enumerate(random_prompts(3, seed=31, min_len=20, max_len=45)):
        for params in (SamplingParams(temperature=0, max_tokens=8),
                       SamplingParams(temperature=0.9, top_p=0.9, seed=5 + i, max_tokens=8)):
            expected = ref.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
            got, moved, inserted = _handoff(p, d, prompt, params, f"r{i}-{params.temperature}")
            assert got == list(expected)
            assert moved == inserted  # each prompt is new to the decode engine the first time, cached after
            total += moved
    assert total >= 6
    for llm in (p, d):
        bm = llm.llm_engine.core.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not llm.llm_engine.core.scheduler.kv_leases.leases


def test_a_block_corrupted_on_the_wire_is_refused_and_recomputed(model_factory):
    model_dir = model_factory("llama")
    ref, p, d = _engine(model_dir), _engine(model_dir), _engine(model_dir)
    prompt = random_prompts(1, seed=32, min_len=40, max_len=41)[0]
    params = SamplingParams(temperature=0, max_tokens=6)
    expected = ref.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    got, moved, inserted = _handoff(p, d, prompt, params, "bad", corrupt=True)
    assert moved >= 3 and inserted == 1  # the block before the bad one only
    assert got == list(expected)


def test_a_lease_ends_on_expiry_and_frees_the_blocks(model_factory):
    p = _engine(model_factory("llama"))
    core = p.llm_engine.core
    core.scheduler.kv_leases.lease_s = 0.05
    prompt = random_prompts(1, seed=33, min_len=30, max_len=31)[0]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    _run(core, _request(p, "held", prompt, params, do_remote_decode=True))
    bm = core.scheduler.block_manager
    held = core.scheduler.kv_leases.leases["held"].blocks
    assert len(held) == len(prompt) // BLOCK and all(bm.pool.ref_cnt[b] == 1 for b in held)
    time.sleep(0.06)
    core.scheduler.schedule()  # each schedule ends the leases past their deadline
    assert not core.scheduler.kv_leases.leases and core.scheduler.kv_leases.num_expired == 1
    assert all(bm.pool.ref_cnt[b] == 0 for b in held) and bm.num_free_blocks == bm.num_blocks
    assert not core.release_kv("held")


def test_a_prompt_that_stops_at_its_first_token_ends_there(model_factory):
    """``max_tokens=1`` (or a stop token first) ends the request on the prefill side as usual: no handoff."""
    llm = _engine(model_factory("llama"))
    core = llm.llm_engine.core
    prompt = random_prompts(1, seed=34, min_len=20, max_len=21)[0]
    tokens, _, reasons, _ = _run(core, _request(llm, "one", prompt, SamplingParams(temperature=0, max_tokens=1),
                                                do_remote_decode=True))
    assert len(tokens) == 1 and reasons == ["length"] and not core.scheduler.kv_leases.leases
