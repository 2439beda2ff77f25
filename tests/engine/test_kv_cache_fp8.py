"""``kv_cache_dtype="fp8"`` end to end: the cache really is fp8 and holds twice the blocks of bf16 in the same memory;
greedy tokens stay within vLLM's top-5 rule of the bf16 cache's; prefix caching, swap preemption, n-gram speculation,
structured output and tensor parallelism work over it; a bad value is refused."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.common.sampling_params import StructuredOutputsParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.kernels.cpu import moe as cpu_moe
from pagedserve.tests.engine.test_bf16 import TOP, assert_close_greedy
from pagedserve.tests.utils import assert_all_blocks_free, random_prompts

MAX_TOKENS = 16
KV_BYTES = 1 << 22


# Python the demo model (trained on the standard library) continues with confidence: a random model's near-uniform
# logits flip at any perturbation, which says nothing about the cache.
CODE_PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
                "    for i in range(len(items)):\n", "try:\n    import json\nexcept ImportError:\n",
                "def __repr__(self):\n        return"]


def greedy_with_tops(llm: LLM, prompts: list, **kw) -> tuple[list[list[int]], list[list[set[int]]]]:
    prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=TOP, **kw),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [[set(lp) for lp in o.outputs[0].logprobs] for o in outs]


def runner(llm: LLM):
    return llm.llm_engine.core.executor.worker.model_runner


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache_greedy_close_to_bf16_cache(device, kv_cache_dtype):
    prompts = CODE_PROMPTS
    args = dict(dtype="bfloat16", device=device, max_num_seqs=4, max_num_batched_tokens=16, kv_cache_memory=KV_BYTES)
    with LLM(**args) as llm:
        ref, ref_tops = greedy_with_tops(llm, prompts)
        bf16_blocks = llm.llm_engine.core.config.cache_config.num_blocks
    with LLM(kv_cache_dtype=kv_cache_dtype, **args) as llm:
        r = runner(llm)
        want = torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
        assert all(c.dtype == want for c in r.k_caches + r.v_caches)
        assert r.backend.name == ("cpu" if device == "cpu" else "triton")
        assert llm.llm_engine.core.config.cache_config.num_blocks == 2 * bf16_blocks
        ours, our_tops = greedy_with_tops(llm, prompts)
        assert_all_blocks_free(llm)
    matched = sum(assert_close_greedy(o, ot, r_, rt) for o, ot, r_, rt in zip(ours, our_tops, ref, ref_tops))
    assert matched >= len(prompts) * MAX_TOKENS // 2, f"only {matched} tokens equal before divergence: is fp8 broken?"


def test_fp8_cache_with_prefix_caching_swap_speculation_and_structured_output(model_factory):
    model_dir = model_factory("llama")
    prompts = random_prompts(4, seed=12, min_len=20, max_len=50)
    with LLM(model_dir, kv_cache_dtype="fp8", kv_cache_memory=KV_BYTES) as llm:
        assert llm.llm_engine.core.config.cache_config.num_blocks == KV_BYTES // runner(llm).kv_bytes_per_block()
        plain, _ = greedy_with_tops(llm, prompts)
        # Prefix caching: the same prompts again hit their cached blocks and give the same tokens.
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == plain
        assert all(o.num_cached_tokens > 0 for o in outs)
        # Structured output over the fp8 cache.
        choice = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(
            temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
            use_tqdm=False)[0].outputs[0].text
        assert choice in ("yes", "no")
        assert_all_blocks_free(llm)
    # n-gram speculation: the same greedy tokens as without it (the drafts are verified against the fp8 cache).
    with LLM(model_dir, kv_cache_dtype="fp8", kv_cache_memory=KV_BYTES,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        assert greedy_with_tops(llm, prompts)[0] == plain
    # Swap preemption: parallel samples in a cache too small for all of them move fp8 blocks out and back in, and
    # come out as they do with room to spare.
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=48, ignore_eos=True)
    results, swapped = [], []
    for blocks in (400, 40):
        with LLM(model_dir, kv_cache_dtype="fp8", num_gpu_blocks_override=blocks, block_size=8,
                 preemption_mode="swap", max_num_seqs=6) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
            results.append([[c.token_ids for c in o.outputs] for o in outs])
            swapped.append(llm.llm_engine.core.scheduler.stats.num_swapped_out_blocks)
            assert_all_blocks_free(llm)
    assert swapped[0] == 0 and swapped[1] > 0
    assert results[0] == results[1]


def test_fp8_cache_under_tensor_parallel_equals_one_rank(ray_cluster, model_factory):
    model_dir = model_factory("llama-gqa8")
    prompts = random_prompts(4, seed=13)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with LLM(model_dir, kv_cache_dtype="fp8") as llm:
        one = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)]
    with LLM(model_dir, kv_cache_dtype="fp8", tensor_parallel_size=2, distributed_executor_backend="ray") as llm:
        two = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)]
    assert one == two


def test_fp8_cache_and_int8_weights_together_on_a_moe_model(model_factory):
    """Both options on Mixtral (experts quantized like any linear, the router not): greedy tokens stay within the
    top-5 rule of the plain bf16 model's. Every expert is active: a random router sits near ties, where a rounding
    error swaps an expert and the logits jump, which is no error of either option (transformers 5.25's random
    weights put such a swap into this test's top-2 model)."""
    model_dir = model_factory("mixtral", num_experts_per_tok=4)
    prompts = random_prompts(4, seed=14)
    with LLM(model_dir, dtype="bfloat16") as llm:
        ref, ref_tops = greedy_with_tops(llm, prompts)
    with LLM(model_dir, dtype="bfloat16", kv_cache_dtype="fp8", quantization="int8") as llm:
        model = runner(llm).model
        experts = [m for n, m in model.named_modules() if n.endswith("experts.0.down_proj")]
        packed = [m.moe_panels for m in model.modules() if getattr(m, "moe_panels", None) is not None]
        if cpu_moe.bf16_available():  # the int8 experts went to the fused MoE kernel's int8 panels
            assert packed and all(p.w13.dtype == torch.int8 and p.w2_scale is not None for p in packed)
        else:
            assert experts and experts[0].weight_scale is not None
        ours, our_tops = greedy_with_tops(llm, prompts)
    for o, ot, r_, rt in zip(ours, our_tops, ref, ref_tops):
        assert_close_greedy(o, ot, r_, rt)


def test_bad_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="fp4").create_engine_config()
