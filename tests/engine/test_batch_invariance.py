"""On CPU, with the panel GEMM, a request's tokens and logprobs do not depend on what it is batched with: every
kernel computes a row the same way whatever else is in the step (the GEMM sums in k order whatever tile a row
lands in; attention, norms and rotary work per row; the sampler's draws come from a counter-based hash)."""
from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.kernels.cpu import gemm_bf16 as cpu_gemm_bf16
from pagedserve.tests.utils import random_prompts
from pagedserve.worker.cpu import packing as cpu_linear


# bf16: the AVX512-BF16 panel GEMM, or its AMX tiles where the CPU has them (one kernel for every row count).
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not cpu_gemm_bf16.available(), reason="no AVX512-BF16 on this CPU"))])
def test_outputs_alone_and_in_a_batch_are_bitwise_equal(model_factory, monkeypatch, dtype):
    monkeypatch.setattr(cpu_linear, "panel_gemm_preferred", lambda flags=None: True)
    # The reference model's widths (K = 512 and 1376), where GEMM libraries block k for cache.
    model = model_factory("llama", hidden_size=512, intermediate_size=1376, num_attention_heads=8,
                          num_key_value_heads=8)
    prompts = random_prompts(13, seed=3, min_len=20, max_len=60)
    params = [SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, logprobs=5, ignore_eos=True)]
    params += [params[0]] * (len(prompts) - 2)
    # A 64-token budget: in the batch, prompts are split into prefill chunks that run beside other decodes.
    with LLM(model, skip_tokenizer_init=True, dtype=dtype, seed=0, max_num_batched_tokens=64) as llm:
        alone = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0]
                 for p, sp in zip(prompts[:3], params)]
        llm.reset_prefix_cache()
        batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for one, many in zip(alone, batched):
        assert one.token_ids == many.outputs[0].token_ids
        assert one.logprobs == many.outputs[0].logprobs
