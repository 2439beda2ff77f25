"""Odd sizes under tensor parallelism on Ray: each rank's shard (intermediate 200 -> 100 columns a rank at TP 2,
300 -> 100 at TP 3; hidden 90 / 78, head sizes 80 / 96, vocab 331) runs the fast kernels, and greedy equals HF."""
from __future__ import annotations

import pytest

from pagedserve import LLM
from pagedserve.tests.utils import assert_greedy_equals_hf, random_prompts


@pytest.mark.parametrize("arch, tp", [("llama-odd-hd80", 2), ("llama-odd-hd96", 3)])
def test_odd_shapes_tp_greedy_matches_hf(ray_cluster, model_factory, arch, tp):
    model_dir = model_factory(arch)
    prompts = random_prompts(3, seed=90 + tp, max_len=20)
    llm = LLM(model_dir, tensor_parallel_size=tp, distributed_executor_backend="ray")
    try:
        assert_greedy_equals_hf(llm, model_dir, prompts, 8)
    finally:
        llm.shutdown()
