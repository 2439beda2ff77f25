"""Phi-3's LongRoPE against transformers: a sequence that stays within original_max_position_embeddings uses the
short factors, one that starts beyond it the long factors (a sequence crossing it mid-decode is not compared: HF
then recomputes its whole cache with the long factors)."""
from __future__ import annotations

from pagedserve import LLM, SamplingParams
from pagedserve.tests.utils import hf_greedy, load_hf_reference, random_prompts


def test_short_and_long_factors_match_hf(model_factory):
    model_dir = model_factory("phi3", original_max_position_embeddings=32)
    short, long = random_prompts(1, seed=3, min_len=10, max_len=10)[0], random_prompts(1, seed=4, min_len=40)[0]
    cases = [(short, 16), (long, 16)]  # 10 + 16 tokens stay within 32; 40 start beyond it
    llm = LLM(model_dir, max_num_seqs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in cases],
                        [SamplingParams(temperature=0, max_tokens=n) for _, n in cases], use_tqdm=False)
    hf = load_hf_reference(model_dir)
    for (prompt, n), out in zip(cases, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, n, hf)[0]
