"""Continuous batching under pressure: chunked prefill, preemption, aborts, limits, block accounting."""
from __future__ import annotations

import pytest

from pagedserve import LLM, EngineArgs, LLMEngine, SamplingParams
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.request import Sequence
from pagedserve.tests.utils import assert_all_blocks_free, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def reference(llama_dir):
    prompts = random_prompts(10, seed=3, max_len=60)
    llm = LLM(llama_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


def test_chunked_prefill_same_outputs(llama_dir, reference):
    prompts, expected = reference
    llm = LLM(llama_dir, max_num_batched_tokens=7, max_decode_stall_ms=0)  # vLLM v1's mixing
    seen_mixed = []
    sched = llm.llm_engine.core.scheduler
    orig = sched.schedule

    def spy():
        out = orig()
        sizes = list(out.num_scheduled_tokens.values())
        seen_mixed.append(any(n == 1 for n in sizes) and any(n > 1 for n in sizes))
        assert out.total_num_scheduled_tokens <= 7
        return out

    sched.schedule = spy
    assert _tokens(llm, prompts) == expected
    assert any(seen_mixed), "no step mixed a prefill chunk with decodes"
    assert_all_blocks_free(llm)


def test_preemption_same_outputs(llama_dir, reference):
    prompts, expected = reference
    llm = LLM(llama_dir, num_gpu_blocks_override=10)
    assert _tokens(llm, prompts) == expected
    assert llm.llm_engine.core.scheduler.stats.num_preemptions["recompute"] > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("blocks", [None, 10])
def test_decode_stall_same_outputs(llama_dir, reference, blocks):
    """Holding decodes back while prompts prefill changes which rows share a step, never a token."""
    prompts, expected = reference
    llm = LLM(llama_dir, max_num_batched_tokens=16, max_decode_stall_ms=60_000, num_gpu_blocks_override=blocks)
    sched = llm.llm_engine.core.scheduler
    orig = sched.schedule
    held = []

    def spy():
        decoding = {r.request_id for r in sched.running if r.seqs[0].num_tokens - r.seqs[0].num_computed_tokens == 1}
        out = orig()
        ran = {sched.seqs[i][0].request_id for i in out.num_scheduled_tokens}
        held.append(bool(decoding - ran) and any(n > 1 for n in out.num_scheduled_tokens.values()))
        return out

    sched.schedule = spy
    assert _tokens(llm, prompts) == expected
    assert any(held), "no decode sat out a prefill step"
    assert_all_blocks_free(llm)


def test_chunked_prefill_disabled(llama_dir, reference):
    prompts, expected = reference
    llm = LLM(llama_dir, enable_chunked_prefill=False)
    assert _tokens(llm, prompts) == expected


def test_max_num_seqs_respected(llama_dir, reference):
    prompts, expected = reference
    llm = LLM(llama_dir, max_num_seqs=3)
    sched = llm.llm_engine.core.scheduler
    orig = sched.schedule

    def spy():
        out = orig()
        assert len(sched.running) <= 3
        return out

    sched.schedule = spy
    assert _tokens(llm, prompts) == expected


def test_abort_at_any_point(llama_dir, reference):
    prompts, expected = reference
    engine = LLMEngine.from_engine_args(EngineArgs(model=llama_dir, max_num_batched_tokens=16, max_num_seqs=4))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    engine.abort_request("9")  # still waiting
    engine.step()
    running = [r.request_id for r in engine.core.scheduler.running]
    engine.abort_request(running[0])  # mid prefill or decoding
    for _ in range(3):
        engine.step()
    engine.abort_request(running[-1])
    aborted = {"9", running[0], running[-1]}
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert aborted.isdisjoint(done)
    for rid, out in done.items():
        assert out.outputs[0].token_ids == expected[int(rid)]
    assert_all_blocks_free(engine)


def test_abort_unknown_and_twice_is_harmless(llama_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=llama_dir))
    engine.abort_request("nope")
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    engine.abort_request("a")
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_block_manager_allocates_on_demand():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence(seq_id=0, index=0, token_ids=list(range(10)), prompt_len=10, seed=0)
    assert bm.allocate_slots(seq, 10) and len(seq.block_table) == 3
    seq.num_computed_tokens = 10
    assert bm.allocate_slots(seq, 2) and len(seq.block_table) == 3  # fits in the last block
    seq.num_computed_tokens = 12
    assert bm.allocate_slots(seq, 1) and len(seq.block_table) == 4
    assert bm.num_free_blocks == 4
    assert not bm.allocate_slots(seq, 100)
    assert len(seq.block_table) == 4  # a failed allocation leaves the table alone
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []
    with pytest.raises(RuntimeError):
        bm.pool.decref([0])


def test_kv_waste_only_in_last_block(llama_dir):
    llm = LLM(llama_dir)
    prompts = random_prompts(16, seed=5, max_len=60)
    _tokens(llm, prompts)
    st = llm.llm_engine.core.scheduler.stats
    # With 16 tokens a block, only the tail of each sequence's last block may be empty.
    assert 0 < st.waste_sum / st.num_steps < 0.5
    assert st.peak_blocks_used <= sum(-(-(len(p) + 24) // 16) for p in prompts)


@pytest.mark.parametrize("shared", [False, True])
def test_kv_waste_counts_each_block_once(llama_dir, shared):
    """Each step's waste is 1 - tokens in distinct used blocks / their slots, whether blocks are private (the
    per-sequence sum) or shared by forks and cached prefixes (a block held twice counts once)."""
    llm = LLM(llama_dir, seed=0)
    sched = llm.llm_engine.core.scheduler
    record, seen = sched._record_stats, []

    def checked() -> None:
        before = sched.stats.waste_sum
        record()
        used = sched.block_manager.num_blocks - sched.block_manager.num_free_blocks
        if used:
            bs = sched.block_size
            distinct = {b: min(bs, s.num_computed_tokens - i * bs)
                        for r in sched.running for s in r.live_seqs for i, b in enumerate(s.block_table)}
            seen.append((sched.stats.waste_sum - before, max(0.0, 1.0 - sum(distinct.values()) / (used * bs)),
                         len(distinct) < sum(len(s.block_table) for r in sched.running for s in r.live_seqs)))

    sched._record_stats = checked
    prompts = random_prompts(6, seed=7, max_len=50)
    if shared:  # a common 40-token prefix, and 3 completions per prompt forked after the prefill
        prompts = [prompts[0][:40] + p for p in prompts]
        params = SamplingParams(temperature=0.8, n=3, max_tokens=20, seed=1)
    else:
        params = SamplingParams(temperature=0, max_tokens=20)
    _tokens(llm, prompts, params)
    assert seen and all(got == pytest.approx(want, abs=1e-12) for got, want, _ in seen)
    assert any(dup for _, _, dup in seen) == shared
