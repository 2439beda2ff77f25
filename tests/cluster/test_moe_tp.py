"""Mixture-of-experts models at tensor_parallel_size=2 on Ray: experts split over the ranks (unequal shards when
the expert count is odd), greedy outputs equal HF."""
from __future__ import annotations

import pytest

from pagedserve import LLM
from pagedserve.tests.utils import assert_greedy_equals_hf, random_prompts


@pytest.mark.parametrize("arch, overrides", [("mixtral", {"num_local_experts": 5}),
                                             ("qwen3_moe", {"num_experts": 3, "norm_topk_prob": False})])
def test_moe_tp2_greedy_matches_hf(ray_cluster, model_factory, arch, overrides):
    model_dir = model_factory(arch, **overrides)
    llm = LLM(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert_greedy_equals_hf(llm, model_dir, random_prompts(4, seed=70), 12)
    finally:
        llm.shutdown()
