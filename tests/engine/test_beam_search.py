"""Beam search inside the engine equals HF generate(num_beams=W) on the same weights."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, BeamSearchParams
from pagedserve.tests.utils import EOS, assert_all_blocks_free, load_hf_reference, random_prompts

MAX_TOKENS = 12


def hf_beams(hf, prompt: list[int], width: int, length_penalty: float, early_stopping) -> list[tuple[list[int], float]]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                          max_new_tokens=MAX_TOKENS, length_penalty=length_penalty, early_stopping=early_stopping,
                          eos_token_id=EOS, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    result = []
    for row, score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
        gen = row[len(prompt):]
        result.append((gen[: gen.index(EOS) + 1] if EOS in gen else gen, score))
    return result


@pytest.mark.parametrize("arch, width, length_penalty, early_stopping", [
    ("llama", 2, 1.0, False), ("llama", 4, 0.5, True), ("llama", 3, 2.0, "never"), ("llama", 4, -1.0, False),
    ("gpt2", 2, 1.0, True), ("gpt2", 4, 0.0, "never"), ("gpt2", 3, 1.5, False),
])
def test_beam_search_matches_hf(model_factory, arch, width, length_penalty, early_stopping):
    model_dir = model_factory(arch)
    llm = LLM(model_dir)
    hf = load_hf_reference(model_dir)
    prompts = random_prompts(3, seed=50 + width, max_len=20)
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        ref = hf_beams(hf, prompt, width, length_penalty, early_stopping)
        assert len(out.sequences) == width
        assert [s.tokens[len(prompt):] for s in out.sequences] == [r[0] for r in ref]
        assert all(s.tokens[: len(prompt)] == prompt for s in out.sequences)
        for s, (_, score) in zip(out.sequences, ref):
            assert abs(s.score - score) < 1e-4 * max(1.0, abs(score))  # length_penalty=-1 multiplies by the length
            n_gen = len(s.tokens) - len(prompt)
            assert abs(s.cum_logprob - s.score * n_gen ** length_penalty) < 1e-3
    assert_all_blocks_free(llm)


def test_dead_beams_free_blocks_and_preemption_keeps_results(llama_dir):
    prompts = random_prompts(4, seed=60, min_len=20, max_len=30)
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS)
    roomy = LLM(llama_dir)
    expected = [[s.tokens for s in o.sequences] for o in roomy.beam_search([{"prompt_token_ids": p} for p in prompts],
                                                                          params)]
    sched = roomy.llm_engine.core.scheduler
    # Blocks in use never exceed what the live beams reference (dropped beams gave theirs back).
    seen = []
    orig = sched.schedule

    def spy():
        out = orig()
        live = {b for r in sched.running for s in r.live_seqs for b in s.block_table}
        seen.append(sched.block_manager.num_blocks - sched.block_manager.num_free_blocks - len(live))
        return out

    sched.schedule = spy
    roomy.beam_search({"prompt_token_ids": prompts[0]}, params)
    assert seen and max(seen) == 0
    assert sched.block_manager.num_copy_on_write > 0
    tight = LLM(llama_dir, num_gpu_blocks_override=14)
    got = [[s.tokens for s in o.sequences] for o in tight.beam_search([{"prompt_token_ids": p} for p in prompts],
                                                                     params)]
    assert got == expected
    assert sum(tight.llm_engine.core.scheduler.stats.num_preemptions.values()) > 0
    assert_all_blocks_free(tight)


def test_beam_search_params_are_checked(llama_dir):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    llm = LLM(llama_dir, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search({"prompt_token_ids": [5] * 60}, BeamSearchParams(beam_width=2, max_tokens=10))
    assert_all_blocks_free(llm)
