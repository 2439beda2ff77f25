"""Every architecture: batched greedy generation with staggered arrivals equals HF generate()."""
from __future__ import annotations

import pytest

from pagedserve import EngineArgs, LLMEngine, SamplingParams
from pagedserve.tests.utils import ARCHS, assert_all_blocks_free, hf_greedy, load_hf_reference, random_prompts

MAX_TOKENS = 24


def run_staggered(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, object]:
    """Add two prompts every other step, so requests join a batch that is already decoding."""
    pending = list(enumerate(prompts))
    results, step = {}, 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            for i, p in pending[:2]:
                engine.add_request(str(i), {"prompt_token_ids": p}, params)
            pending = pending[2:]
        for out in engine.step():
            results[out.request_id] = out
        step += 1
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf(arch, model_factory):
    model_dir = model_factory(arch)
    prompts = random_prompts(8, seed=1)
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, dtype="float32", max_num_seqs=6))
    results = run_staggered(engine, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1))
    hf = load_hf_reference(model_dir)
    total = 0
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_lps = hf_greedy(model_dir, prompt, MAX_TOKENS, hf)
        out = results[str(i)].outputs[0]
        assert out.token_ids == ref_tokens, f"prompt {i} diverged from HF"
        ours = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_lps)) < 1e-4
        assert abs(out.cumulative_logprob - sum(ref_lps)) < 1e-3
        assert all(lp[t].rank == 1 for lp, t in zip(out.logprobs, out.token_ids))  # greedy = top-1
        total += len(out.token_ids)
    assert total > 4 * len(prompts), "outputs too short to compare (EOS too early)"
    assert_all_blocks_free(engine)
