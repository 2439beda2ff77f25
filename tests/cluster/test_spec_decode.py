"""n-gram speculative decoding: greedy and seeded outputs identical to plain decoding (every architecture; with
prefix caching, preemption, chunked prefill and structured output; TP=2 on Ray), sampled outputs keep the model's
distribution, rejected drafts' KV released exactly, and the acceptance counters consistent."""
from __future__ import annotations

import math
import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.common.sampling_params import StructuredOutputsParams
from pagedserve.scheduler.spec_decode import propose_ngram
from pagedserve.tests.utils import ARCHS, assert_all_blocks_free, load_hf_reference, random_prompts

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def copy_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random phrase, so n-grams match and drafts are proposed (and often accepted)."""
    return [p * 3 + p[: len(p) // 2] for p in random_prompts(n, seed, min_len=4, max_len=10)]


def _run(model_dir: str, prompts, params, **kw):
    with LLM(model_dir, seed=0, **kw) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.llm_engine.core.get_stats().scheduler
        assert_all_blocks_free(llm)
    return [[c.token_ids for c in o.outputs] for o in outs], stats


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_with_speculation(arch, model_factory):
    model = model_factory(arch)
    prompts = copy_prompts(6, seed=1) + random_prompts(2, seed=2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain, _ = _run(model, prompts, params)
    spec, stats = _run(model, prompts, params, speculative_config=SPEC)
    assert spec == plain
    assert stats.spec_num_draft_tokens > 0 and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_identical_under_preemption_chunked_prefill_prefix_cache_and_constraints(llama_dir):
    # 20 blocks of 16 for 12 requests of ~60 tokens: preemption; 64-token steps: chunked prefill; a shared prefix.
    shared = random_prompts(1, seed=3, min_len=33, max_len=33)[0]
    prompts = [shared + p for p in copy_prompts(12, seed=4)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=36, ignore_eos=i % 3 != 0,
                             n=2 if i % 4 == 0 else 1, presence_penalty=0.5 if i == 5 else 0.0,
                             min_tokens=10 if i == 7 else 0,
                             structured_outputs=StructuredOutputsParams(regex=r"[a-z ]{5,40}") if i == 9 else None)
              for i in range(12)]
    kw = dict(num_gpu_blocks_override=20, max_num_batched_tokens=64, max_model_len=256)
    plain, base = _run(llama_dir, prompts, params, **kw)
    spec, stats = _run(llama_dir, prompts, params, speculative_config=SPEC, **kw)
    assert spec == plain  # greedy and seeded sampling alike: a draft is kept only where the row's own sample is it
    assert sum(stats.num_preemptions.values()) > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_num_accepted_tokens > 0
    assert stats.spec_num_draft_tokens - stats.spec_num_accepted_tokens > 20  # rejection-heavy, blocks all back
    assert stats.spec_accepted_per_pos[0] >= stats.spec_accepted_per_pos[-1]
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    assert stats.num_steps < base.num_steps  # fewer steps for the same tokens


def test_tensor_parallel_identical(ray_cluster, llama_dir):
    prompts = copy_prompts(4, seed=6)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain, _ = _run(llama_dir, prompts, params)
    spec, stats = _run(llama_dir, prompts, params, tensor_parallel_size=2, speculative_config=SPEC)
    assert spec == plain and stats.spec_num_accepted_tokens > 0


def _chi2_below_p001(counts: torch.Tensor, expected: torch.Tensor) -> bool:
    keep = expected >= 5
    chi2 = float((((counts - expected) ** 2 / expected)[keep]).sum())
    dof = int(keep.sum()) - 1
    # The chi-square 0.999 quantile (Wilson-Hilferty): a correct sampler fails one run in a thousand.
    return chi2 < dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3


def test_sampled_distribution_is_the_models(model_factory):
    """At temperature 1, the tokens sampled at drafted positions follow the model's distribution: the counts of
    the 2nd and 3rd output tokens over 1500 seeds against the model's probabilities given each sample's prefix."""

    model = model_factory("llama", vocab_size=8, initializer_range=0.05)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    n = 1500
    params = [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=3, ignore_eos=True) for i in range(n)]
    outs, stats = _run(model, [prompt] * n, params, speculative_config=dict(SPEC, disable_by_batch_size=256),
                       max_num_seqs=256)
    assert stats.spec_num_draft_tokens > 300 and stats.spec_num_accepted_tokens > 10  # 3rd tokens from draft rows
    hf = load_hf_reference(model)
    samples = torch.tensor([o[0] for o in outs])
    for pos in (1, 2):
        prefixes, which = torch.unique(samples[:, :pos], dim=0, return_inverse=True)
        with torch.no_grad():
            ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], dim=1)
            probs = torch.softmax(hf(ids).logits[:, -1].double(), dim=-1)
        expected = probs[which].sum(dim=0)
        counts = torch.bincount(samples[:, pos], minlength=8).double()
        assert _chi2_below_p001(counts, expected), (pos, counts.tolist(), expected.tolist())


def _propose_reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, one window at a time: the longest suffix that occurred before, its latest occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start: start + n] == suffix:
                return tokens[start + n: start + n + k]
    return []


def test_propose_ngram_matches_its_definition():
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 5, 50])) for _ in range(rng.randrange(0, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k = rng.randrange(0, 6)
        want = _propose_reference(tokens, min_n, max_n, k) if k else []
        assert propose_ngram(tokens, min_n, max_n, k) == want, (tokens, min_n, max_n, k)
