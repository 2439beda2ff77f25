"""Memory sharing: prefix caching, parallel sampling with copy-on-write, swap preemption."""
from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.scheduler import block_manager
from pagedserve.scheduler.request import child_seed
from pagedserve.tests.utils import assert_all_blocks_free, random_prompts


def _prefix_prompts() -> list[list[int]]:
    base = random_prompts(1, seed=40, min_len=70, max_len=70)[0]
    tails = random_prompts(10, seed=41, min_len=1, max_len=20)
    cuts = [0, 1, 15, 16, 17, 31, 32, 33, 48, 64]
    prompts = [base[:c] + t for c, t in zip(cuts, tails)]
    prompts += [base[:32], base[:48], base[:48], base]  # entirely cached prefixes, at block boundaries
    return prompts


def _outs(llm: LLM, prompts, params):
    return [[c.token_ids for c in o.outputs]
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def _stats(llm: LLM):
    return llm.llm_engine.core.scheduler.stats


@pytest.fixture(scope="module")
def no_cache(llama_dir):
    return LLM(llama_dir, enable_prefix_caching=False)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=12),
                                    SamplingParams(temperature=1.0, seed=7, max_tokens=12)],
                         ids=["greedy", "seeded"])
def test_prefix_caching_is_invisible(llama_dir, no_cache, params):
    prompts = _prefix_prompts()
    expected = _outs(no_cache, prompts, params)
    llm = LLM(llama_dir, max_num_seqs=4)  # few at a time, so later prompts find earlier blocks cached
    assert _outs(llm, prompts, params) == expected
    first_hits = _stats(llm).prefix_cache_hits
    assert first_hits > 0
    assert _outs(llm, prompts, params) == expected  # everything cached now
    st = _stats(llm)
    assert st.prefix_cache_hits - first_hits >= sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert_all_blocks_free(llm)


def test_prefix_caching_with_chunked_prefill_and_preemption(llama_dir, no_cache):
    prompts = _prefix_prompts()
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = _outs(no_cache, prompts, params)
    llm = LLM(llama_dir, max_num_batched_tokens=24, num_gpu_blocks_override=14)
    assert _outs(llm, prompts, params) == expected
    assert _stats(llm).num_preemptions["recompute"] > 0 and _stats(llm).prefix_cache_hits > 0
    assert_all_blocks_free(llm)


def test_cache_salt_isolates_and_reset_clears(llama_dir):
    llm = LLM(llama_dir)
    prompt = random_prompts(1, seed=42, min_len=50, max_len=50)[0]
    params = SamplingParams(temperature=0, max_tokens=4)
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, params, use_tqdm=False)
    hits = _stats(llm).prefix_cache_hits
    out_b = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, params, use_tqdm=False)[0]
    assert _stats(llm).prefix_cache_hits == hits and out_b.num_cached_tokens == 0
    out_a = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, params, use_tqdm=False)[0]
    assert out_a.num_cached_tokens == 48
    llm.reset_prefix_cache()
    again = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == out_a.outputs[0].token_ids == out_b.outputs[0].token_ids


def test_hash_collisions_never_serve_wrong_kv(llama_dir, no_cache, monkeypatch):
    monkeypatch.setattr(block_manager, "hash_block", lambda parent, toks, salt: b"\x00" * 16)
    prompts = _prefix_prompts()
    params = SamplingParams(temperature=0, max_tokens=10)
    llm = LLM(llama_dir, max_num_seqs=3)
    assert _outs(llm, prompts, params) == _outs(no_cache, prompts, params)
    assert_all_blocks_free(llm)


def test_parallel_sampling_children_equal_solo_runs(llama_dir, no_cache):
    prompt = random_prompts(1, seed=43, min_len=21, max_len=21)[0]  # 21 % 16 != 0: the tail block is shared
    llm = LLM(llama_dir)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    for c in out.outputs:
        solo = no_cache.generate({"prompt_token_ids": prompt},
                                 SamplingParams(temperature=1.0, seed=child_seed(5, c.index), max_tokens=20,
                                                ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0]
        assert c.token_ids == solo.token_ids
    stats = llm.llm_engine.core.get_stats()
    assert stats.copy_on_write == 2  # the shared partial block was copied for all but one child
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.kv_blocks_shared == 0
    assert _stats(llm).num_scheduled_tokens == 21 + 3 * 19  # the prompt ran once, then 3 x 19 decodes
    assert_all_blocks_free(llm)


def test_best_of_returns_most_likely(llama_dir, no_cache):
    prompt = random_prompts(1, seed=44)[0]
    out = LLM(llama_dir).generate({"prompt_token_ids": prompt},
                                  SamplingParams(n=2, best_of=4, temperature=1.0, seed=9, max_tokens=10),
                                  use_tqdm=False)[0].outputs
    solos = [no_cache.generate({"prompt_token_ids": prompt},
                               SamplingParams(temperature=1.0, seed=child_seed(9, j), max_tokens=10, logprobs=0),
                               use_tqdm=False)[0].outputs[0] for j in range(4)]
    best = sorted(solos, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in out] == [c.token_ids for c in best]
    assert [c.index for c in out] == [0, 1]
    assert all(abs(a.cumulative_logprob - b.cumulative_logprob) < 1e-4 for a, b in zip(out, best))


@pytest.mark.parametrize("mode", [None, "swap", "recompute"])
def test_swap_and_recompute_give_identical_outputs(llama_dir, mode):
    prompts = random_prompts(6, seed=45, max_len=40)
    params = [SamplingParams(n=1 + i % 3, temperature=1.0, seed=i, max_tokens=20) for i in range(6)]
    roomy = LLM(llama_dir)
    expected = _outs(roomy, prompts, params)
    tight = LLM(llama_dir, num_gpu_blocks_override=12, preemption_mode=mode, swap_space=0.001)
    assert _outs(tight, prompts, params) == expected
    st = _stats(tight)
    if mode == "recompute":
        assert st.num_preemptions["swap"] == 0 and st.num_preemptions["recompute"] > 0
    else:
        assert st.num_preemptions["swap"] > 0 and st.num_swapped_in_blocks == st.num_swapped_out_blocks > 0
    assert_all_blocks_free(tight)
    cpu_pool = tight.llm_engine.core.scheduler.block_manager.cpu_pool
    assert cpu_pool.num_free == cpu_pool.num_blocks


def test_sharing_disabled_baseline_same_outputs_more_blocks(llama_dir):
    prompts = random_prompts(4, seed=46, min_len=30, max_len=40)
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    shared = LLM(llama_dir, enable_prefix_caching=False)
    private = LLM(llama_dir, enable_prefix_caching=False, enable_block_sharing=False)
    assert _outs(shared, prompts, params) == _outs(private, prompts, params)
    assert _stats(private).peak_blocks_used > _stats(shared).peak_blocks_used
    assert_all_blocks_free(private)


def test_sharing_disabled_with_swap_preemption(llama_dir):
    prompts = random_prompts(6, seed=47, min_len=20, max_len=40)
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=20, ignore_eos=True)
    expected = _outs(LLM(llama_dir, enable_prefix_caching=False), prompts, params)
    tight = LLM(llama_dir, enable_prefix_caching=False, enable_block_sharing=False, num_gpu_blocks_override=16)
    assert _outs(tight, prompts, params) == expected
    assert _stats(tight).num_preemptions["swap"] > 0
    assert_all_blocks_free(tight)


def test_swap_during_chunked_prefill(llama_dir):
    """A request swapped out mid-prefill comes back with room for its next chunk, not just one token."""
    prompts = random_prompts(6, seed=48, min_len=30, max_len=60)
    params = SamplingParams(n=2, best_of=3, temperature=1.0, seed=6, max_tokens=12, ignore_eos=True)
    expected = _outs(LLM(llama_dir, enable_prefix_caching=False), prompts, params)
    for sharing in (True, False):
        tight = LLM(llama_dir, enable_prefix_caching=False, enable_block_sharing=sharing, preemption_mode="swap",
                    max_num_batched_tokens=20, num_gpu_blocks_override=18)
        assert _outs(tight, prompts, params) == expected
        assert _stats(tight).num_preemptions["swap"] > 0
        assert_all_blocks_free(tight)
