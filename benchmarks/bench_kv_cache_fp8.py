"""fp8 KV cache against the model's dtype at one fixed KV budget, side by side (alternating) in one run.

    python benchmarks/bench_kv_cache_fp8.py [--model bench-llama-58m] [--kv-mib 256 2048] [--pairs 2]
    python benchmarks/bench_kv_cache_fp8.py --model bench-llama-7b-shape --device cuda --kv-mib 8192 --pairs 1

For each budget: KV blocks, output tok/s, preemptions and peak blocks used on the sharegpt-like workload, for
``kv_cache_dtype="auto"`` (bf16 on CUDA, and on CPUs with bf16 instructions, as ``dtype="auto"`` picks) and
``"fp8"`` (fp8_e4m3). A budget too small for the workload's batch shows what twice the blocks buy (fewer
preemptions); an ample one shows what reading fp8 costs when memory is not the limit. Results:
benchmarks/results/kv_cache_fp8-<machine>.json.
Accuracy is a test's job (tests/engine/test_kv_cache_fp8.py: vLLM's top-5 rule against the bf16 cache).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import REFERENCE_MODELS, make_workload, reference_model, save_results
from bench_throughput import _release, run_pagedserve

from pagedserve.worker.cpu import auto_dtype as cpu_auto_dtype

KV_DTYPES = ("auto", "fp8")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-llama-58m", choices=sorted(REFERENCE_MODELS))
    ap.add_argument("--kv-mib", type=int, nargs="+", default=[256, 2048], help="KV budgets in MiB")
    ap.add_argument("--requests", type=int, default=256, help="the first N sharegpt-like requests")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default="kv_cache_fp8")
    args = ap.parse_args()

    model_dir = reference_model(args.model)
    dtype = "bfloat16" if args.device == "cuda" else str(cpu_auto_dtype(torch.bfloat16)).removeprefix("torch.")
    full = make_workload("sharegpt")
    wl = type(full)("sharegpt", full.prompts[: args.requests], full.output_lens[: args.requests])
    print(f"{args.model} ({dtype}), {len(wl.prompts)} sharegpt-like requests: {wl.num_prompt_tokens} prompt + "
          f"{wl.num_output_tokens} output tokens")
    rows = []
    for mib in args.kv_mib:
        runs: dict[str, list[dict]] = {kv: [] for kv in KV_DTYPES}
        for _ in range(args.pairs):
            for kv in KV_DTYPES:
                runs[kv].append(run_pagedserve(model_dir, wl, args.max_num_seqs, args.device, dtype=dtype,
                                               kv_cache_dtype=kv, kv_cache_memory=mib << 20))
                _release(args.device)
        row = {"kv_mib": mib}
        for kv, rs in runs.items():
            best = max(rs, key=lambda r: r["output_tok_s"])
            row[kv] = {**best, "output_tok_s_runs": [r["output_tok_s"] for r in rs],
                       "output_tok_s_median": statistics.median(r["output_tok_s"] for r in rs)}
        row["block_ratio"] = row["fp8"]["kv_blocks_total"] / row["auto"]["kv_blocks_total"]
        row["throughput_ratio"] = row["fp8"]["output_tok_s"] / row["auto"]["output_tok_s"]
        rows.append(row)
        for kv in KV_DTYPES:
            r = row[kv]
            print(f"  {mib:5d} MiB  {kv:5s} {r['kv_blocks_total']:6d} blocks (peak {r['kv_blocks_peak']}), "
                  f"{r['output_tok_s']:7.1f} out tok/s (runs {', '.join(f'{x:.1f}' for x in r['output_tok_s_runs'])})"
                  f", {r['preemptions']} preemptions, {r['steps']} steps")
        print(f"  {mib:5d} MiB  fp8 / {dtype}: {row['block_ratio']:.2f}x blocks, {row['throughput_ratio']:.2f}x "
              "output tok/s")
    print("saved", save_results(args.out, {"model": args.model, "device": args.device, "dtype": dtype,
                                           "requests": len(wl.prompts), "pairs": args.pairs, "budgets": rows}))


if __name__ == "__main__":
    main()
