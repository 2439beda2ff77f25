"""Odd sizes under tensor parallelism on Ray: each rank's shard (intermediate 200 -> 100 columns a rank at TP 2,
300 -> 100 at TP 3; hidden 90 / 78, head sizes 80 / 96, vocab 331) runs the fast kernels, and greedy equals HF."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.tests.utils import hf_greedy, random_prompts


@pytest.mark.parametrize("arch, tp", [("llama-odd-hd80", 2), ("llama-odd-hd96", 3)])
def test_odd_shapes_tp_greedy_matches_hf(ray_cluster, model_factory, arch, tp):
    model_dir = model_factory(arch)
    prompts = random_prompts(3, seed=90 + tp, max_len=20)
    llm = LLM(model_dir, tensor_parallel_size=tp, distributed_executor_backend="ray")
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(model_dir, p, 8, hf)[0]
