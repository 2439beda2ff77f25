"""Qwen3, Phi-3 and Gemma 2/3 split over two Ray ranks: greedy tokens equal HF's (one prompt each, past Gemma's
sliding window)."""
from __future__ import annotations

import pytest

from pagedserve import LLM
from pagedserve.tests.utils import assert_greedy_equals_hf, random_prompts


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma2", "gemma3"])
def test_tp2_greedy_matches_hf(ray_cluster, model_factory, arch):
    model_dir = model_factory(arch)
    prompt = random_prompts(1, seed=60, min_len=30, max_len=30)[0]
    llm = LLM(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert_greedy_equals_hf(llm, model_dir, [prompt], 16)
    finally:
        llm.shutdown()
