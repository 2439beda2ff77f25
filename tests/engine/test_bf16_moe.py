"""MoE models in bf16 on CPU against Hugging Face in bf16, by vLLM's top-5 rule (``test_bf16.py``)."""
from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM
from pagedserve.kernels import torch_ref
from pagedserve.kernels.cpu import moe as cpu_moe
from pagedserve.tests.engine.test_bf16 import assert_bf16_close_to_hf
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
    blocks = [m for m in model.modules() if hasattr(m, "expert_ids")]
    assert blocks and all(isinstance(getattr(b, "moe_panels", None), cpu_moe.MoeBF16Panels) == cpu_moe.bf16_available()
                          for b in blocks)  # the fused bf16 kernel wherever it is built
    assert_bf16_close_to_hf(llm, model_dir, prompts)


# Every linear quantize_linears quantizes: attention, experts (Mixtral's w1/w2/w3, Qwen3-MoE's *_proj), the LM head;
# not the routers (``.gate.weight``).
QUANTIZED = re.compile(r"(\.((q|k|v|o|gate|up|down)_proj|w[123])\.weight|^lm_head\.weight)$")


def dequantized_copy(src: str, dst: str) -> str:
    """The checkpoint with every weight that ``quantization="int8"`` quantizes replaced by ``q * scale`` (in bf16):
    the model the int8 engine runs, for Hugging Face to run."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    for name, w in tensors.items():
        if QUANTIZED.search(name):
            q, scale = torch_ref.quantize_int8(w)
            tensors[name] = (q.float() * scale[:, None]).to(w.dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


@pytest.mark.skipif(not cpu_moe.bf16_available(), reason="the fused int8 MoE kernel needs AVX512-BF16")
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_int8_experts_close_to_the_dequantized_model(arch, model_factory, tmp_path):
    """Weight-only int8 experts on the fused bf16 kernel: the dequantized checkpoint's greedy tokens under HF in
    bf16, by the top-5 rule."""
    src = decisive_router_copy(model_factory(arch), str(tmp_path / arch))
    model_dir = dequantized_copy(src, str(tmp_path / f"{arch}-dequantized"))
    llm = LLM(src, dtype="bfloat16", quantization="int8", max_num_seqs=4, max_num_batched_tokens=64)
    model = llm.llm_engine.core.executor.worker.model_runner.model
    blocks = [m for m in model.modules() if hasattr(m, "expert_ids")]
    assert blocks and all(b.moe_panels.w13.dtype == torch.int8 and b.moe_panels.w13_scale is not None
                          for b in blocks)
    assert_bf16_close_to_hf(llm, model_dir, random_prompts(4, seed=6, max_len=40))
