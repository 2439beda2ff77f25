"""bf16 on CPU against Hugging Face run in bf16, with the check vLLM uses for reduced precision: greedy tokens are
equal up to the first divergence, and there each side's token is in the other's top-5 logprobs. Also: the engine
really runs bf16 end to end (weights, KV cache, the C++ attention), and ``dtype="auto"`` on CPU follows the CPU."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.kernels.cpu import gemm_bf16 as cpu_gemm_bf16
from pagedserve.tests.utils import EOS, load_hf_reference, random_prompts
from pagedserve.worker.cpu.cpuinfo import cpu_flags
from pagedserve.worker.cpu.dtype import FAST_CPU_FLAGS, choose_cpu_dtype
from pagedserve.worker.cpu.dtype import auto_dtype as cpu_auto_dtype

MAX_TOKENS = 16
TOP = 5


def hf_greedy_top(model, prompt: list[int]) -> tuple[list[int], list[set[int]]]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=EOS, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    tokens = out.sequences[0, len(prompt):].tolist()
    tops = [set(torch.log_softmax(lg[0].float(), -1).topk(TOP).indices.tolist()) for lg in out.logits]
    return tokens, tops


def assert_close_greedy(ours: list[int], our_tops: list[set[int]], ref: list[int], ref_tops: list[set[int]]) -> int:
    """vLLM's ``check_logprobs_close``: returns how many tokens matched before the first divergence."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert a in ref_tops[i], f"position {i}: our token {a} not in HF's top-{TOP} {sorted(ref_tops[i])}"
            assert b in our_tops[i], f"position {i}: HF's token {b} not in our top-{TOP} {sorted(our_tops[i])}"
            return i
    return min(len(ours), len(ref))


def assert_bf16_close_to_hf(llm: LLM, model_dir: str, prompts: list[list[int]]) -> None:
    """``llm``'s greedy bf16 outputs against HF's in bf16 by vLLM's rule, and enough equal tokens before any
    divergence that a broken bf16 path cannot pass."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=TOP), use_tqdm=False)
    hf = load_hf_reference(model_dir, torch.bfloat16)
    matched = 0
    for prompt, out in zip(prompts, outs):
        ours = out.outputs[0]
        ref, ref_tops = hf_greedy_top(hf, prompt)
        matched += assert_close_greedy(ours.token_ids, [set(lp) for lp in ours.logprobs], ref, ref_tops)
    assert matched >= len(prompts) * 3, f"only {matched} tokens equal before divergence: bf16 looks broken"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
@pytest.mark.parametrize("arch", ["llama", "llama-gqa8", "gpt_neox", "mistral-swa"])
def test_bf16_greedy_close_to_hf_bf16(arch, device, model_factory):
    model_dir = model_factory(arch)
    prompts = random_prompts(5, seed=5, max_len=60)
    # chunks and mixed batches
    llm = LLM(model_dir, dtype="bfloat16", device=device, max_num_seqs=4, max_num_batched_tokens=64)
    runner = llm.llm_engine.core.executor.worker.model_runner
    assert runner.k_caches[0].dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in runner.model.parameters() if p.is_floating_point())
    assert runner.backend.name == ("cpu" if device == "cpu" else "triton")
    assert runner.attn_layers[0].k_cache.dtype == torch.bfloat16
    if device == "cpu" and cpu_gemm_bf16.available() and arch.startswith("llama"):  # bf16 panels, one-call layers
        assert len(runner.model.model.cpu_layers.weights) == len(runner.model.model.layers)
    assert_bf16_close_to_hf(llm, model_dir, prompts)


def _save_dtype(model_dir: str, dtype: str) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["dtype"] = dtype
    with open(path, "w") as f:
        json.dump(cfg, f)


def test_auto_dtype_on_cpu_follows_the_cpu(model_factory, tmp_path, caplog):
    """A bf16 checkpoint runs in bf16 only where the CPU has bf16 matmul instructions; --dtype overrides."""
    src = model_factory("llama")
    model_dir = str(tmp_path / "bf16-ckpt")
    os.makedirs(model_dir)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as a, open(os.path.join(model_dir, name), "wb") as b:
            b.write(a.read())
    _save_dtype(model_dir, "bfloat16")
    cpu_auto_dtype.cache_clear()
    with caplog.at_level(logging.INFO, logger="pagedserve.worker.cpu.dtype"):
        auto = LLM(model_dir, device="cpu", max_num_seqs=2)
    chosen = auto.llm_engine.core.config.model_config.dtype
    logged = [r.getMessage() for r in caplog.records if "dtype auto on CPU" in r.getMessage()]
    assert logged and logged[0].startswith(f"dtype auto on CPU: {str(chosen).removeprefix('torch.')} (")
    flags = cpu_flags()
    if not any(f in flags for f in FAST_CPU_FLAGS[torch.bfloat16]):
        assert chosen == torch.float32  # this machine kind: AVX2 only
    if "amx_bf16" in flags:  # AMX tiles beat fp32 several times over: the probe must not be swayed by a busy machine
        assert chosen == torch.bfloat16
    explicit = LLM(model_dir, dtype="bfloat16", device="cpu", max_num_seqs=2)
    assert explicit.llm_engine.core.config.model_config.dtype == torch.bfloat16


def test_cpu_dtype_choice_needs_flags_and_a_faster_matmul():
    assert choose_cpu_dtype(torch.float32, {"amx_bf16"})[0] == torch.float32
    calls = []

    def probe(dtype):
        calls.append(dtype)
        return 0.05

    assert choose_cpu_dtype(torch.bfloat16, {"avx2"}, probe)[0] == torch.float32 and not calls  # no flags: no probe
    assert choose_cpu_dtype(torch.bfloat16, {"avx512_bf16"}, probe)[0] == torch.float32 and calls == [torch.bfloat16]
    assert choose_cpu_dtype(torch.bfloat16, {"amx_bf16"}, lambda d: 2.5)[0] == torch.bfloat16
    assert choose_cpu_dtype(torch.float16, {"avx512_bf16"}, lambda d: 2.5)[0] == torch.float32  # fp16 needs fp16
    assert choose_cpu_dtype(torch.float16, {"amx_fp16"}, lambda d: 2.5)[0] == torch.float16
