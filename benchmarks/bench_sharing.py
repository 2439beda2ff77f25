"""Memory sharing, measured: KV blocks saved by parallel sampling and beam search, throughput at a
fixed KV budget with and without sharing, and prefix caching on a shared-prefix workload.

    python benchmarks/bench_sharing.py [--model bench-llama-58m] [--prompts 32] [--max-tokens 48]

The seeds (vLLM's paper, as retold in ../shared/seeds) report 6-30% KV savings for parallel
sampling, 37-66% for beam search and up to 2.2x throughput; ours are printed beside them.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__file__))
from bench_common import REFERENCE_MODELS, make_workload, reference_model, save_results

from pagedserve import LLM, BeamSearchParams, EngineArgs, LLMEngine, SamplingParams

SEEDS = {"parallel": "6-30%", "beam": "37-66%", "throughput": "up to 2.2x"}


def _spy_blocks(llm: LLM) -> list[tuple[int, int]]:
    """Per step: (blocks actually used, blocks the same sequences would hold if none were shared)."""
    sched = llm.llm_engine.core.scheduler
    samples: list[tuple[int, int]] = []
    orig = sched.schedule

    def spy():
        out = orig()
        seqs = [s for r in sched.running for s in r.live_seqs]
        if seqs:
            samples.append((len({b for s in seqs for b in s.block_table}), sum(len(s.block_table) for s in seqs)))
        return out

    sched.schedule = spy
    return samples


def _run(model_dir: str, prompts, kind: str, width: int, max_tokens: int, **engine) -> dict:
    engine.setdefault("kv_cache_memory", 1 << 30)
    llm = LLM(model_dir, skip_tokenizer_init=True, enable_prefix_caching=False, **engine)
    samples = _spy_blocks(llm)
    items = [{"prompt_token_ids": p} for p in prompts]
    t = time.perf_counter()
    if kind == "parallel":
        outs = llm.generate(items, SamplingParams(n=width, temperature=1.0, seed=0, max_tokens=max_tokens,
                                                  ignore_eos=True), use_tqdm=False)
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    else:
        outs = llm.beam_search(items, BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
        tokens = sum(len(o.sequences[0].tokens) - len(p) for o, p in zip(outs, prompts)) * width
    dt = time.perf_counter() - t
    st = llm.llm_engine.core.scheduler.stats
    return {"seconds": dt, "output_tok_s": tokens / dt, "peak_blocks": st.peak_blocks_used,
            "preemptions": sum(st.num_preemptions.values()),
            "savings_mean": statistics.mean(1 - used / total for used, total in samples),
            "copy_on_write": llm.llm_engine.core.scheduler.block_manager.num_copy_on_write}


def sharing_table(model_dir: str, n_prompts: int, max_tokens: int) -> dict:
    results = {}
    for wl_name in ("alpaca", "sharegpt"):
        wl = make_workload(wl_name)
        prompts = [p[:256] for p in wl.prompts[:n_prompts]]
        for kind in ("parallel", "beam"):
            for width in (2, 4, 6):
                shared = _run(model_dir, prompts, kind, width, max_tokens)
                private = _run(model_dir, prompts, kind, width, max_tokens, enable_block_sharing=False)
                # Fixed KV budget: 40% of what the private run peaked at, so it must preempt.
                budget = max(8, int(private["peak_blocks"] * 0.4))
                fixed_shared = _run(model_dir, prompts, kind, width, max_tokens, num_gpu_blocks_override=budget)
                fixed_private = _run(model_dir, prompts, kind, width, max_tokens, num_gpu_blocks_override=budget,
                                     enable_block_sharing=False)
                row = {
                    "kv_savings_mean": shared["savings_mean"],
                    "peak_blocks_shared": shared["peak_blocks"], "peak_blocks_private": private["peak_blocks"],
                    "peak_savings": 1 - shared["peak_blocks"] / private["peak_blocks"],
                    "budget_blocks": budget,
                    "tok_s_shared": fixed_shared["output_tok_s"], "tok_s_private": fixed_private["output_tok_s"],
                    "throughput_gain": fixed_shared["output_tok_s"] / fixed_private["output_tok_s"],
                    "preemptions_shared": fixed_shared["preemptions"],
                    "preemptions_private": fixed_private["preemptions"],
                }
                results[f"{wl_name}/{kind}/{width}"] = row
                print(f"{wl_name:8s} {kind:8s} {width}: KV saved {row['kv_savings_mean']:6.1%} (mean per step), "
                      f"{row['peak_savings']:6.1%} at peak  [seeds: {SEEDS[kind]}]; at {budget} blocks "
                      f"{row['tok_s_shared']:7.1f} vs {row['tok_s_private']:7.1f} tok/s = "
                      f"{row['throughput_gain']:.2f}x [seeds: {SEEDS['throughput']}]", flush=True)
    return results


def prefix_caching(model_dir: str) -> dict:
    wl = make_workload("shared-prefix")
    results = {}
    for on in (False, True):
        engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, skip_tokenizer_init=True,
                                                       enable_prefix_caching=on, kv_cache_memory=1 << 30))
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        t = time.perf_counter()
        for i, p in enumerate(wl.prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        ttft = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                ttft.append(out.metrics["time_to_first_token"])
        dt = time.perf_counter() - t
        st = engine.core.scheduler.stats
        results["on" if on else "off"] = {
            "seconds": dt, "output_tok_s": wl.num_output_tokens / dt,
            "total_tok_s": (wl.num_output_tokens + wl.num_prompt_tokens) / dt,
            "mean_ttft_s": statistics.mean(ttft),
            "hit_rate": st.prefix_cache_hits / max(st.prefix_cache_queries, 1)}
    on, off = results["on"], results["off"]
    results["throughput_gain"] = on["output_tok_s"] / off["output_tok_s"]
    results["ttft_speedup"] = off["mean_ttft_s"] / on["mean_ttft_s"]
    print(f"shared-prefix: caching off {off['output_tok_s']:.1f} tok/s, TTFT {off['mean_ttft_s']:.2f}s; "
          f"on {on['output_tok_s']:.1f} tok/s, TTFT {on['mean_ttft_s']:.2f}s, hit rate {on['hit_rate']:.1%} -> "
          f"{results['throughput_gain']:.2f}x throughput, {results['ttft_speedup']:.2f}x faster TTFT")
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-llama-58m", choices=sorted(REFERENCE_MODELS))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--parts", nargs="+", default=["prefix", "sharing"], choices=["prefix", "sharing"])
    args = ap.parse_args()
    model_dir = reference_model(args.model)
    results = {"model": args.model, "prompts": args.prompts, "max_tokens": args.max_tokens, "seeds": SEEDS}
    if "prefix" in args.parts:
        results["prefix_caching"] = prefix_caching(model_dir)
    if "sharing" in args.parts:
        results["sharing"] = sharing_table(model_dir, args.prompts, args.max_tokens)
    print("saved", save_results("sharing", results))
    plot(results)


def plot(results: dict) -> None:
    if "sharing" not in results:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from bench_common import results_path

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for kind, ax in zip(("parallel", "beam"), axes):
        for wl in ("alpaca", "sharegpt"):
            widths = [2, 4, 6]
            ax.plot(widths, [100 * results["sharing"][f"{wl}/{kind}/{w}"]["kv_savings_mean"] for w in widths],
                    marker="o", label=f"{wl} KV saved")
        ax.set_xlabel("n" if kind == "parallel" else "beam width")
        ax.set_ylabel("% KV blocks saved by sharing")
        ax.set_title(f"{'parallel sampling' if kind == 'parallel' else 'beam search'} (seeds: {SEEDS[kind]})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(results_path("sharing", "png"), dpi=110)


if __name__ == "__main__":
    main()
