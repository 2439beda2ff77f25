"""Priority scheduling on a real (tiny, random) model: urgent requests start at once by preempting worse ones, and
every preempted request still ends with exactly the tokens it has when run alone, greedy and seeded; priority is
refused where it would be ignored, as vLLM does."""
from __future__ import annotations

import pytest

from pagedserve import LLM, EngineArgs, LLMEngine, SamplingParams
from pagedserve.common.errors import InvalidRequestError
from pagedserve.tests.utils import assert_all_blocks_free, random_prompts


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=24, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return done


def test_urgent_requests_preempt_and_every_request_keeps_its_tokens(llama_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=llama_dir, seed=0, max_num_seqs=3,
                                                   scheduling_policy="priority", max_decode_stall_ms=0))
    try:
        prompts = random_prompts(6, seed=11, min_len=5, max_len=30)
        for i in range(3):
            engine.add_request(f"bulk{i}", {"prompt_token_ids": prompts[i]}, _params(i), priority=5)
        for _ in range(4):
            engine.step()
        for i in range(3, 6):
            engine.add_request(f"urgent{i}", {"prompt_token_ids": prompts[i]}, _params(i), priority=-1)
        engine.step()  # all three urgent ones start in the step after they arrive
        sched = engine.core.scheduler
        assert all(sched.requests[f"urgent{i}"].first_scheduled_time is not None for i in range(3, 6))
        done = _run(engine)
        assert sched.stats.num_preemptions["recompute"] == 3
        assert_all_blocks_free(engine)
        # Alone, one at a time, on the same engine: the same tokens.
        for i in range(6):
            name = f"bulk{i}" if i < 3 else f"urgent{i}"
            engine.add_request(f"alone{i}", {"prompt_token_ids": prompts[i]}, _params(i))
            assert _run(engine)[f"alone{i}"] == done[name], name
    finally:
        engine.core.shutdown()


def test_llm_generate_takes_a_priority_per_prompt(llama_dir):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, seed=5)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with LLM(llama_dir, scheduling_policy="priority", max_num_seqs=1) as llm:
        prioritized = llm.generate(prompts, params, use_tqdm=False, priority=[2, 0, 1])
        plain = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in prioritized] == [o.outputs[0].token_ids for o in plain]
        with pytest.raises(ValueError, match="got 2 priorities for 3 prompts"):
            llm.generate(prompts, params, use_tqdm=False, priority=[0, 1])
        with pytest.raises(InvalidRequestError, match="priority must be an integer"):
            llm.generate(prompts[:1], params, use_tqdm=False, priority=[0.5])


def test_a_priority_under_fcfs_is_refused_not_ignored(llama_dir):
    with LLM(llama_dir) as llm:
        with pytest.raises(InvalidRequestError, match="needs --scheduling-policy priority"):
            llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False, priority=[1])
        assert llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False, priority=[0])[0].finished
