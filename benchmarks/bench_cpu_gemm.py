"""The CPU linears' kernels side by side on the reference shapes' linears: the bf16 panel GEMM on AMX tiles and on
AVX512-BF16, oneDNN's prepacked linear (what vLLM's CPU build runs) and the int8 panels (AMX, AVX-512), at 1-512
rows; with ``--dtype float32``, the fp32 panel GEMM, oneDNN's prepacked fp32 linear and the int8 panels on fp32 rows.

    python benchmarks/bench_cpu_gemm.py [--models bench-qwen2-0.5b-shape bench-llama-1b-shape] [--rows 1 8 32 128 512]
                                  [--dtype bfloat16]

For each model, row count and kernel: the time of one pass over all of a decoder layer's linears (qkv, o_proj,
gate_up, down, at TP=1), best of ``--repeat`` alternating rounds, as GFLOP/s and as GB/s of weights read. bf16 needs
a CPU with AVX512-BF16 (the AMX rows only where it has AMX). Results: benchmarks/results/cpu_gemm-<cpu>.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import REFERENCE_MODELS, save_results

from pagedserve.kernels import torch_ref
from pagedserve.kernels.cpu import gemm as cpu_gemm
from pagedserve.kernels.cpu import gemm_bf16 as cpu_gemm_bf16
from pagedserve.kernels.cpu import gemm_int8 as cpu_gemm_int8


def layer_weights(cfg: dict, gen: torch.Generator) -> list[torch.Tensor]:
    """A decoder layer's linear weights [N, K] in bf16: qkv, o_proj, gate_up, down."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim", h // cfg["num_attention_heads"])
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d
    shapes = [(qkv, h), (h, cfg["num_attention_heads"] * d), (2 * i, h), (h, i)]
    return [(torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16) for n, k in shapes]


def fp32_kernels(weights: list[torch.Tensor]) -> dict[str, Callable[[list[torch.Tensor]], None]]:
    """name -> a pass over all the (fp32) weights for the fp32 rows given (one input per weight's K)."""
    panels = [cpu_gemm.pack_weight(w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 128) for w in weights]
    int8 = [cpu_gemm_int8.pack_weight(*torch_ref.quantize_int8(w)) for w in weights]
    return {
        "panel_fp32": lambda xs: [cpu_gemm.gemm(x, p) for x, p in zip(xs, panels)],
        "onednn": lambda xs: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                              for x, p in zip(xs, onednn)],
        "int8": lambda xs: [cpu_gemm_int8.gemm(x, p) for x, p in zip(xs, int8)],
    }


def kernels(weights: list[torch.Tensor]) -> dict[str, Callable[[list[torch.Tensor]], None]]:
    """name -> a pass over all the weights for the rows given (one input per weight's K)."""
    panels = [cpu_gemm_bf16.pack_weight(w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 128) for w in weights]
    int8 = [cpu_gemm_int8.pack_weight(*torch_ref.quantize_int8(w)) for w in weights]
    out: dict[str, Callable[[list[torch.Tensor]], None]] = {
        "avx512_bf16": lambda xs: [cpu_gemm_bf16.gemm(x, p, use_amx=False) for x, p in zip(xs, panels)],
        "onednn": lambda xs: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                              for x, p in zip(xs, onednn)],
        "int8_avx512": lambda xs: [cpu_gemm_int8.gemm(x, p, use_amx=False) for x, p in zip(xs, int8)],
    }
    if cpu_gemm_bf16.amx():
        out["amx"] = lambda xs: [cpu_gemm_bf16.gemm(x, p) for x, p in zip(xs, panels)]
        out["int8_amx"] = lambda xs: [cpu_gemm_int8.gemm(x, p) for x, p in zip(xs, int8)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["bench-qwen2-0.5b-shape", "bench-llama-1b-shape"],
                    choices=sorted(REFERENCE_MODELS))
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 128, 512])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="cpu_gemm")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16 and not cpu_gemm_bf16.available():
        sys.exit("no AVX512-BF16 on this CPU: the bf16 panel GEMM is not built (--dtype float32 runs the fp32 ones)")
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for name in args.models:
        weights = [w.to(dtype) for w in layer_weights(REFERENCE_MODELS[name], gen)]
        flop_per_row = sum(2 * w.numel() for w in weights)
        dense_bytes = sum(w.nbytes for w in weights)
        runs = kernels(weights) if dtype == torch.bfloat16 else fp32_kernels(weights)
        for m in args.rows:
            xs = [torch.randn(m, w.shape[1], generator=gen).to(dtype) for w in weights]
            calls = max(1, int(2e10 / (flop_per_row * m)))  # ~0.1 s a round at 200 GFLOP/s
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(args.repeat):
                for kernel, run in runs.items():
                    run(xs)
                    t = time.perf_counter()
                    for _ in range(calls):
                        run(xs)
                    best[kernel] = min(best[kernel], (time.perf_counter() - t) / calls)
            for kernel, s in best.items():
                nbytes = (sum(w.numel() + 4 * w.shape[0] for w in weights) if "int8" in kernel
                          else dense_bytes)
                rows_out.append({"model": name, "rows": m, "kernel": kernel, "ms": s * 1e3,
                                 "gflop_s": flop_per_row * m / s / 1e9, "weight_gb_s": nbytes / s / 1e9})
            line = "  ".join(f"{k} {flop_per_row * m / s / 1e9:7.1f}" for k, s in best.items())
            print(f"{name} rows {m:4d} GFLOP/s: {line}", flush=True)
    print("saved", save_results(args.out, {"threads": torch.get_num_threads(), "amx": cpu_gemm_bf16.amx(),
                                           "dtype": args.dtype, "rows": rows_out}))


if __name__ == "__main__":
    main()
