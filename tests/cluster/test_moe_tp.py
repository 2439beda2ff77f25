"""Mixture-of-experts models at tensor_parallel_size=2 on Ray: experts split over the ranks (unequal shards when
the expert count is odd), greedy outputs equal HF."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.tests.utils import hf_greedy, random_prompts


@pytest.mark.parametrize("arch, overrides", [("mixtral", {"num_local_experts": 5}),
                                             ("qwen3_moe", {"num_experts": 3, "norm_topk_prob": False})])
def test_moe_tp2_greedy_matches_hf(ray_cluster, model_factory, arch, overrides):
    model_dir = model_factory(arch, **overrides)
    llm = LLM(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        prompts = random_prompts(4, seed=70)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=12, logprobs=0), use_tqdm=False)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        for p, o in zip(prompts, outs):
            tokens, lps = hf_greedy(model_dir, p, 12, hf)
            assert o.outputs[0].token_ids == tokens
            ours = [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
            assert max(abs(a - b) for a, b in zip(ours, lps)) < 1e-4
    finally:
        llm.shutdown()
