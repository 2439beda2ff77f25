"""Weight-only int8 vs the unquantized model's decode throughput on CPU, side by side (alternating) in one run.

    python benchmarks/bench_quant.py [--models bench-qwen2-0.5b-shape bench-llama-1b-shape] [--batches 1 2 4 8]
                               [--dtype auto]

The unquantized model and the int8 model's activations run in ``--dtype``: ``auto`` is the engine's own pick (bf16
where this CPU has bf16 matmul instructions, else fp32, where bf16 would be emulated).

Each batch size runs ``--batch`` identical-length prompts (``--prompt-len`` random tokens, prefix caching off),
greedy with ignore_eos for ``--output-len`` tokens; decode tok/s = batch x (output_len - 1) / (time of the run - time
of the same run with one output token). Also the weight bytes a decode step reads (every linear and the LM head;
embeddings read a few rows), the GB/s that makes at the measured step time, and the measured memory read rate
(``roofline.read_bandwidth``). Saves benchmarks/results/quant-<machine>.json.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import reference_model, save_results
from bench_roofline import read_bandwidth

from pagedserve import LLM, SamplingParams
from pagedserve.worker.cpu.dtype import auto_dtype


def weight_bytes_per_step(llm: LLM) -> int:
    """Bytes of every linear weight (packed copy where there is one, scales included) and of the LM head."""
    model = llm.llm_engine.core.executor.worker.model_runner.model
    total = 0
    for m in model.modules():
        panels = getattr(m, "panel_weight", None)
        packed = getattr(m, "packed_weight", None)
        if panels is not None:
            total += panels.panels.nbytes + (panels.scale.nbytes if hasattr(panels, "scale") else 0)
        elif packed is not None:
            total += packed.numel() * packed.element_size()
        elif getattr(m, "packable", False):
            total += m.weight.nbytes + (m.weight_scale.nbytes if hasattr(m, "weight_scale") else 0)
    return total


def run_once(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["bench-qwen2-0.5b-shape", "bench-llama-1b-shape"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2, help="alternating runs per system and batch size (best kept)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    args = ap.parse_args()
    dtype = str(auto_dtype(torch.bfloat16) if args.dtype == "auto" else getattr(torch, args.dtype))
    base = {"torch.bfloat16": "bf16", "torch.float32": "fp32"}[dtype]
    print(f"unquantized: {base}")
    bandwidth = read_bandwidth()
    print(f"memory read rate: {bandwidth / 1e9:.1f} GB/s")
    results = []

    def save() -> str:  # after every row: a run cut short keeps what it measured
        return save_results("quant", {"device": "cpu", "threads": torch.get_num_threads(),
                                      "memory_read_gb_s": bandwidth / 1e9, "unquantized_dtype": base,
                                      "prompt_len": args.prompt_len,
                                      "output_len": args.output_len, "results": results})

    for name in args.models:
        path = reference_model(name)
        llms = {q or base: LLM(path, dtype=dtype.removeprefix("torch."), quantization=q, enable_prefix_caching=False,
                               max_model_len=512, kv_cache_memory=1 << 30) for q in (None, "int8")}
        vocab = llms[base].llm_engine.config.model_config.vocab_size
        nbytes = {k: weight_bytes_per_step(v) for k, v in llms.items()}
        rng = random.Random(0)
        for batch in args.batches:
            prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
            times: dict[str, dict[str, list[float]]] = {k: {"full": [], "prefill": []} for k in llms}
            for llm in llms.values():  # warm-up
                run_once(llm, prompts, 2)
            for _ in range(args.repeat):
                for k, llm in llms.items():
                    times[k]["full"].append(run_once(llm, prompts, args.output_len))
                    times[k]["prefill"].append(run_once(llm, prompts, 1))
            row = {"model": name, "batch": batch}
            for k in llms:
                decode = min(times[k]["full"]) - statistics.median(times[k]["prefill"])
                step = decode / (args.output_len - 1)
                row[k] = {"decode_tok_s": batch / step, "step_ms": 1e3 * step, "weight_bytes": nbytes[k],
                          "weight_gb_s": nbytes[k] / step / 1e9}
            row["speedup"] = row["int8"]["decode_tok_s"] / row[base]["decode_tok_s"]
            results.append(row)
            print(f"{name} batch {batch}: {base} {row[base]['decode_tok_s']:.1f} tok/s "
                  f"({row[base]['weight_gb_s']:.1f} GB/s), int8 {row['int8']['decode_tok_s']:.1f} tok/s "
                  f"({row['int8']['weight_gb_s']:.1f} GB/s): {row['speedup']:.2f}x", flush=True)
            save()
        for llm in llms.values():
            llm.shutdown()
        del llms
        gc.collect()
    print(f"saved {save()}")


if __name__ == "__main__":
    main()
