"""bf16 Qwen3, Phi-3 and Gemma 2/3 against HF in bf16 by vLLM's top-5 rule (``test_bf16.assert_close_greedy``)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.tests.engine.test_bf16 import MAX_TOKENS, TOP, assert_close_greedy, hf_greedy_top
from pagedserve.tests.utils import random_prompts


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma2", "gemma3"])
def test_bf16_greedy_close_to_hf_bf16(arch, model_factory):
    model_dir = model_factory(arch)
    prompts = random_prompts(3, seed=7, min_len=20, max_len=40)
    llm = LLM(model_dir, dtype="bfloat16", max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=TOP), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    matched = 0
    for prompt, out in zip(prompts, outs):
        ref, ref_tops = hf_greedy_top(hf, prompt)
        ours = out.outputs[0]
        matched += assert_close_greedy(ours.token_ids, [set(lp) for lp in ours.logprobs], ref, ref_tops)
    assert matched >= len(prompts) * 3, f"only {matched} tokens equal before divergence: bf16 looks broken"
