"""benchmarks/bench_roofline.py: the model FLOPs MFU counts (prompts included) and the floor's replay of the scheduler,
whose step count must be the engine's own on the same workload."""
from __future__ import annotations

import json
import os
import random
import re

import pytest

from pagedserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def roofline(load_benchmark):
    return load_benchmark("roofline")


def _workload(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 300) for _ in range(rng.randrange(3, 90))] for _ in range(n)], \
        [rng.randrange(1, 30) for _ in range(n)]


def test_model_flops_count_prompts_decodes_and_attention(roofline):
    cfg = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=96, vocab_size=500)
    prompts, outs = _workload(9, seed=1)
    r = roofline.roofline(cfg, [len(p) for p in prompts], outs, 2, peak_flops=1e12, read_bw=1e11)
    layer = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 96)
    want = 0.0
    for p, o in zip(prompts, outs):
        n = len(p) + o - 1  # the last sampled token is never fed back
        want += 2 * layer * n + 2 * 64 * 500 * o + 4 * 2 * 64 * n * (n + 1) / 2
    assert r.model_flops == pytest.approx(want, rel=1e-12)
    kv = sum(2 * 2 * 32 * 2 * (len(p) + i + 1) for p, o in zip(prompts, outs) for i in range(o - 1))
    assert r.kv_read_bytes == pytest.approx(kv, rel=1e-12)
    slower = roofline.roofline(cfg, [len(p) for p in prompts], outs, 2, peak_flops=1e12, read_bw=5e10)
    assert slower.floor_s > r.floor_s and 0 < r.mfu(r.floor_s, 1e12) < 1


@pytest.mark.parametrize("stall_ms", [0, 60_000])
@pytest.mark.parametrize("budget", [64, 2048])
def test_replay_takes_the_engines_steps(roofline, llama_dir, budget, stall_ms):
    with open(os.path.join(llama_dir, "config.json")) as f:
        cfg = json.load(f)
    prompts, outs = _workload(24, seed=budget)
    llm = LLM(llama_dir, seed=0, max_num_batched_tokens=budget, enable_prefix_caching=False,
              max_decode_stall_ms=stall_ms)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs], use_tqdm=False)
    steps = llm.llm_engine.core.scheduler.stats.num_steps
    r = roofline.roofline(cfg, [len(p) for p in prompts], outs, 4, 1e12, 1e11, max_num_batched_tokens=budget,
                          prefill_first=stall_ms > 0)
    assert r.steps == steps
    if budget == 64:  # prompts outgrow one step: the two schedules differ
        other = roofline.roofline(cfg, [len(p) for p in prompts], outs, 4, 1e12, 1e11, max_num_batched_tokens=budget,
                                  prefill_first=stall_ms == 0)
        assert other.steps != steps


def test_results_files_are_named_by_cpu_model(load_benchmark):
    """One results file per benchmark per machine kind: benchmarks/results/<benchmark>-<cpu slug>.json."""
    common = load_benchmark("common")
    assert common.cpu_slug("AMD EPYC 9R14 96-Core Processor", 25, 17) == "epyc-zen4"
    assert common.cpu_slug("AMD EPYC 9R45 192-Core Processor", 26, 2) == "epyc-zen5"
    assert common.cpu_slug("Intel(R) Xeon(R) Platinum 8488C", 6, 143) == "xeon-spr"
    slug = common.cpu_slug()
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", slug), slug
    assert os.path.basename(common.results_path("throughput", "json")) == f"throughput-{slug}.json"
    names = [n for n in os.listdir(common.RESULTS) if os.path.isfile(os.path.join(common.RESULTS, n))]
    assert names and all(re.fullmatch(r"[a-z][a-z0-9_]*-[a-z0-9-]+\.(json|png)", n) for n in names
                         if n != "INDEX.md"), names
    # A GPU run (benchmarks/gpu_check.sh) keeps its logs beside its results, in results/gpu/; earlier runs are in
    # results/archive/.
    gpu = os.path.join(common.RESULTS, "gpu")
    subdirs = sorted(n for n in os.listdir(common.RESULTS) if os.path.isdir(os.path.join(common.RESULTS, n)))
    assert set(subdirs) <= {"archive", "gpu"} and all(
        re.fullmatch(r"[a-z][a-z0-9_]*(-[a-z0-9-]+)?\.(json|png|log|txt)", n)
        for n in (os.listdir(gpu) if "gpu" in subdirs else [])), subdirs
