"""bf16 Qwen3, Phi-3 and Gemma 2/3 against HF in bf16 by vLLM's top-5 rule (``test_bf16.assert_close_greedy``)."""
from __future__ import annotations

import pytest

from pagedserve import LLM
from pagedserve.tests.engine.test_bf16 import assert_bf16_close_to_hf
from pagedserve.tests.utils import random_prompts


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma2", "gemma3"])
def test_bf16_greedy_close_to_hf_bf16(arch, model_factory):
    model_dir = model_factory(arch)
    prompts = random_prompts(3, seed=7, min_len=20, max_len=40)
    llm = LLM(model_dir, dtype="bfloat16", max_num_seqs=4)
    assert_bf16_close_to_hf(llm, model_dir, prompts)
