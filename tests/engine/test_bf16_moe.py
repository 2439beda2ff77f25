"""MoE models in bf16 on CPU against Hugging Face in bf16, by vLLM's top-5 rule (``test_bf16.py``)."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.tests.engine.test_bf16 import MAX_TOKENS, TOP, assert_close_greedy, hf_greedy_top
from pagedserve.tests.utils import random_prompts


def decisive_router_copy(src: str, dst: str, factor: float = 4.0) -> str:
    """The checkpoint with its router weights scaled up. A random router leaves near-ties between the k-th and the
    next expert on many tokens, where one bf16 rounding on either side flips the choice and that token's output
    outright; trained routers are far more decisive."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    for name in tensors:
        if name.endswith(".gate.weight"):
            tensors[name] = tensors[name] * factor
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_bf16_greedy_close_to_hf_bf16(arch, model_factory, tmp_path):
    model_dir = decisive_router_copy(model_factory(arch), str(tmp_path / arch))
    prompts = random_prompts(4, seed=6, max_len=40)
    llm = LLM(model_dir, dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=64)
    model = llm.llm_engine.core.executor.worker.model_runner.model
    assert all(p.dtype == torch.bfloat16 for p in model.parameters() if p.is_floating_point())
    assert model.model.cpu_layers is None  # MoE layers stay off the one-call C++ layer
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=TOP), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    matched = 0
    for prompt, out in zip(prompts, outs):
        ref, ref_tops = hf_greedy_top(hf, prompt)
        matched += assert_close_greedy(out.outputs[0].token_ids, [set(lp) for lp in out.outputs[0].logprobs],
                                       ref, ref_tops)
    assert matched >= len(prompts) * 3, f"only {matched} tokens equal before divergence: bf16 looks broken"
