"""End to end: the Triton attention backend generates exactly what the torch reference does."""
from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.tests.utils import assert_all_blocks_free, random_prompts


@pytest.mark.parametrize("arch,block_size", [
    ("llama", 16),
    # a 16-key window on every layer: blocks below it are freed (NULL_BLOCK in the table) as sequences grow
    ("mistral-swa", 8),
])
def test_triton_backend_matches_torch(arch, block_size, model_factory):
    # head_dim 64 with 2 query heads per KV head: a shape the kernels are built for.
    model_dir = model_factory(arch, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=64, intermediate_size=128)
    prompts = random_prompts(3, seed=70, min_len=14, max_len=35)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    # chunked prefill mixed with decodes
    kwargs = dict(dtype="float32", max_num_batched_tokens=24, enable_prefix_caching=False, block_size=block_size)
    ref = LLM(model_dir, attention_backend="torch", **kwargs).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tri = LLM(model_dir, attention_backend="triton", **kwargs)
    assert tri.llm_engine.core.executor.worker.model_runner.backend.name == "triton"
    got = tri.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob) < 1e-4
    assert_all_blocks_free(tri)
