"""Sliding-window models: greedy generation equals HF generate() with prompts and outputs longer than the window
(plain, chunked prefill, prefix caching), and HF's reference really applies its window."""
from __future__ import annotations

import pytest
import torch

from pagedserve import EngineArgs, LLMEngine, SamplingParams
from pagedserve.tests.engine.test_models_parity import run_staggered
from pagedserve.tests.utils import assert_all_blocks_free, hf_greedy, load_hf_reference, random_prompts

MAX_TOKENS = 30


def test_hf_reference_applies_the_window(model_factory):
    hf = load_hf_reference(model_factory("mistral-swa"))
    ids = torch.tensor([random_prompts(1, seed=3, min_len=40, max_len=40)[0]])
    with torch.no_grad():
        windowed = hf(ids).logits
        hf.config.sliding_window = None
        full = hf(ids).logits
    torch.testing.assert_close(windowed[:, :16], full[:, :16])  # the window covers the first 16 positions
    assert (windowed[:, 16:] - full[:, 16:]).abs().max() > 1e-2


@pytest.mark.parametrize("arch,args", [
    ("mistral-swa", {}),
    ("mistral-swa", dict(max_num_batched_tokens=24, block_size=8)),  # chunks that start past the window
    ("qwen2-swa", dict(block_size=8)),  # layer 0 full, layer 1 sliding
])
def test_greedy_matches_hf_beyond_the_window(arch, args, model_factory):
    model_dir = model_factory(arch)
    prompts = random_prompts(6, seed=2, min_len=10, max_len=60)
    prompts.append(prompts[0][:40] + prompts[1][:5])  # a cached prefix longer than the window
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, dtype="float32", max_num_seqs=4, **args))
    results = run_staggered(engine, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    hf = load_hf_reference(model_dir)
    for i, prompt in enumerate(prompts):
        ref, _ = hf_greedy(model_dir, prompt, MAX_TOKENS, hf)
        got = results[str(i)].outputs[0].token_ids
        n = ref.index(2) + 1 if 2 in ref else len(ref)  # hf_greedy stops at EOS; we ignore it
        assert got[:n] == ref[:n], f"prompt {i} diverged from HF"
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("arch,bounded", [("mistral-swa", True), ("mistral", False)])
def test_kv_blocks_below_the_window_are_freed(arch, bounded, model_factory):
    """A sequence of every-layer-sliding Mistral holds ceil(window / block_size) + 1 blocks once past its prompt;
    without a window its blocks grow with it. All are free at the end."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_factory(arch), block_size=8))
    bm = engine.core.scheduler.block_manager
    engine.add_request("0", {"prompt_token_ids": random_prompts(1, seed=5, min_len=12, max_len=12)[0]},
                       SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    used = []
    while engine.has_unfinished_requests():
        engine.step()
        used.append(bm.num_blocks - bm.num_free_blocks)
    peak = max(used[1:-1])
    if bounded:
        assert peak <= -(-16 // 8) + 1
    else:
        assert peak >= 112 // 8
    assert_all_blocks_free(engine)
