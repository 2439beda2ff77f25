"""n-gram speculative decoding and structured output: what they save and what they cost, side by side in one run.

    python benchmarks/bench_speculative.py [--concurrency 1 4 8 16] [--requests 24]

On the bundled demo model (trained on Python's standard library, so drafts mean something), offline, greedy:
- copy-heavy: each prompt is a standard-library function followed by its first lines again, so the completion
  repeats code the prompt holds (as an edit or a refactoring request does);
- sharegpt-like: the reference workload's random prompts, where drafts rarely match.
Each workload runs with and without speculation at each concurrency (a closed loop: a new request as soon as one
ends), and once more with the batch-size switch-off disabled, to show where drafting stops paying. The three engines
run side by side, one step each in turn, each timed by its own steps (the machine's speed drifts over minutes, which
made back-to-back runs disagree); ratios are medians over --pairs such runs. Printed and saved: output tok/s, mean
per-token latency (a request's time over its output tokens), the acceptance rate (accepted over drafted tokens), the
mean acceptance length (tokens a drafting sequence gained per verifying step, the sampled one included), and how
many steps the batch-size switch-off left without drafts.
Structured output: the median decode-step time at batch 64 with every request under a JSON schema, against none
(and with the bitmask filled before the step instead of during the forward pass), the engines again in turn.
Results: benchmarks/results/speculative-<cpu>.{json,png}.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import make_workload, save_results

from pagedserve import EngineArgs, LLMEngine, SamplingParams
from pagedserve.common.config import default_model_dir
from pagedserve.common.sampling_params import StructuredOutputsParams
from pagedserve.kernels.cpu.backend import CpuBackend

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 9999},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                    "maxItems": 3}},
          "required": ["name", "size", "tags"], "additionalProperties": False}


def copy_heavy_prompts(tokenizer, n: int) -> list[list[int]]:
    """A standard-library function, a blank line, then its first two lines again."""
    import collections
    import json as json_mod
    import textwrap

    sources = []
    for module in (json_mod, textwrap, collections, inspect):
        for _, fn in inspect.getmembers(module, inspect.isfunction):
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            if 300 < len(src) < 1500:
                sources.append(src)
    prompts = []
    for src in sources[:n]:
        head = "\n".join(src.splitlines()[:2]) + "\n"
        prompts.append(tokenizer.encode(src + "\n\n" + head))
    return prompts


class _ClosedLoop:
    """One engine serving ``prompts`` at a fixed concurrency, timed by its own clock: the time spent in its steps."""

    def __init__(self, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
                 spec: dict | None) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, speculative_config=spec, seed=0))
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.prompts, self.concurrency, self.spec = prompts, concurrency, spec
        self.todo, self.started, self.latency, self.tokens = list(range(len(prompts))), {}, [], {}
        self.clock = 0.0
        self.idle_steps = 0

    def done(self) -> bool:
        return not self.todo and not self.engine.has_unfinished_requests()

    def step(self) -> None:
        t0 = time.perf_counter()
        while self.todo and len(self.started) - len(self.latency) < self.concurrency:
            i = self.todo.pop(0)
            self.engine.add_request(str(i), {"prompt_token_ids": self.prompts[i]}, self.params)
            self.started[str(i)] = self.clock
        drafts_before = self.engine.core.scheduler.stats.spec_num_drafts
        outs = self.engine.step()
        self.clock += time.perf_counter() - t0
        for out in outs:
            if out.finished:
                n = len(out.outputs[0].token_ids)
                self.latency.append((self.clock - self.started[out.request_id]) / n)
                self.tokens[out.request_id] = out.outputs[0].token_ids
        if self.spec and self.engine.core.scheduler.stats.spec_num_drafts == drafts_before:
            self.idle_steps += 1

    def result(self) -> dict:
        st = self.engine.core.get_stats().scheduler
        self.engine.core.shutdown()
        drafting_steps = max(st.spec_num_drafts, 1)
        return {"concurrency": self.concurrency, "speculative": self.spec is not None,
                "output_tok_s": sum(len(t) for t in self.tokens.values()) / self.clock,
                "mean_token_latency_ms": 1e3 * statistics.mean(self.latency),
                "acceptance_rate": st.spec_num_accepted_tokens / max(st.spec_num_draft_tokens, 1),
                "mean_acceptance_length": (st.spec_num_accepted_tokens + st.spec_num_drafts) / drafting_steps,
                "accepted_per_position": st.spec_accepted_per_pos, "steps_without_drafts": self.idle_steps,
                "tokens": self.tokens}


def run(model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
        specs: dict[str, dict | None]) -> dict[str, dict]:
    """Each configuration in ``specs`` on its own engine, the engines taking one step each in turn, so that this
    machine's drift (tens of percent over minutes) hits them alike; each is timed by the time its own steps take."""
    loops = {k: _ClosedLoop(model, prompts, max_tokens, concurrency, spec) for k, spec in specs.items()}
    while not all(loop.done() for loop in loops.values()):
        for loop in loops.values():
            if not loop.done():
                loop.step()
    return {k: loop.result() for k, loop in loops.items()}


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["mean_token_latency_ms"])[len(runs) // 2]


STEP_KINDS = {"plain": (False, True), "constrained": (True, True), "fill not overlapped": (True, False)}


def step_times(model: str, prompts: list[list[int]], batch: int = 64, steps: int = 40) -> dict[str, dict]:
    """Engine-step times (schedule + execute + update) once ``batch`` requests decode together, for each kind in
    STEP_KINDS (constrained or not, bitmask fill overlapped with the forward pass or not). The engines step in
    turn, one step each, so this machine's drift hits them alike. Also the structured-output parts: the bitmask
    fill and the sampler's masking (inside execute), per step."""

    engines, spent = {}, {}
    for kind, (constrained, overlap) in STEP_KINDS.items():
        engine = LLMEngine.from_engine_args(EngineArgs(model=model, seed=0))
        so = StructuredOutputsParams(json=SCHEMA) if constrained else None
        params = SamplingParams(temperature=0.0, max_tokens=steps + 40, ignore_eos=not constrained,
                                structured_outputs=so)
        for i in range(batch):
            engine.add_request(str(i), {"prompt_token_ids": prompts[i % len(prompts)][:64]}, params)
        core = engine.core
        core.scheduler.overlap_grammar_bitmask = overlap
        while len(core.scheduler.running) < batch or any(s.num_computed_tokens < s.num_tokens - 1
                                                         for r in core.scheduler.running for s in r.seqs):
            engine.step()
        engines[kind], spent[kind] = engine, {"bitmask": 0.0, "mask": 0.0}

    current = [""]

    def timed(key, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[current[0]][key] += time.perf_counter() - t
        return wrapper

    for engine in engines.values():
        structured = engine.core.scheduler.structured
        structured._fill = timed("bitmask", structured._fill)
    apply = CpuBackend.apply_token_bitmask
    CpuBackend.apply_token_bitmask = timed("mask", apply)
    times: dict[str, list[float]] = {k: [] for k in engines}
    try:
        for _ in range(steps):
            for kind, engine in engines.items():
                current[0] = kind
                engine.step()
                s = engine.core.last_step
                if s is not None and s.num_running == batch:
                    times[kind].append(s.schedule + s.execute + s.update)
    finally:
        CpuBackend.apply_token_bitmask = apply
        for engine in engines.values():
            engine.core.shutdown()
    return {k: {"step_s": statistics.median(times[k]), "steps": len(times[k]), "bitmask_s": spent[k]["bitmask"] / steps,
                "mask_s": spent[k]["mask"] / steps} for k in engines}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()
    model = default_model_dir()
    engine = LLMEngine.from_engine_args(EngineArgs(model=model))
    copy = copy_heavy_prompts(engine.tokenizer, args.requests)
    engine.core.shutdown()
    sharegpt = [p[:256] for p in make_workload("sharegpt", vocab=4096).prompts[: args.requests]]
    rows = []
    for name, prompts in (("copy-heavy", copy), ("sharegpt-like", sharegpt)):
        for c in args.concurrency:
            configs = {"off": None, "on": SPEC, "always": dict(SPEC, disable_by_batch_size=1 << 30)}
            runs: dict[str, list[dict]] = {k: [] for k in configs}
            for _ in range(args.pairs):  # the median of the ratios of interleaved runs
                for k, r in run(model, prompts, args.max_tokens, c, configs).items():
                    runs[k].append(r)
            base, spec, always = (median_run(runs[k]) for k in configs)
            want = runs["off"][0]["tokens"]
            assert all(r.pop("tokens") == want for rs in runs.values() for r in rs), "speculation changed tokens"
            row = {"workload": name, "concurrency": c, "off": base, "on": spec, "never_switched_off": always,
                   "latency_ratio": statistics.median(o["mean_token_latency_ms"] / s["mean_token_latency_ms"]
                                                      for o, s in zip(runs["off"], runs["on"])),
                   "throughput_ratio": statistics.median(s["output_tok_s"] / o["output_tok_s"]
                                                         for o, s in zip(runs["off"], runs["on"])),
                   "throughput_ratio_never_switched_off": statistics.median(
                       a["output_tok_s"] / o["output_tok_s"] for o, a in zip(runs["off"], runs["always"]))}
            rows.append(row)
            print(f"{name:13s} c={c:<3d} off {base['output_tok_s']:7.1f} tok/s {base['mean_token_latency_ms']:6.2f} "
                  f"ms/token | on {spec['output_tok_s']:7.1f} tok/s {spec['mean_token_latency_ms']:6.2f} ms/token, "
                  f"accepted {spec['acceptance_rate']:.0%}, {spec['mean_acceptance_length']:.2f} tokens/verify, "
                  f"{spec['steps_without_drafts']} steps without drafts | latency x{row['latency_ratio']:.2f}, "
                  f"throughput x{row['throughput_ratio']:.2f} (never switched off: "
                  f"x{row['throughput_ratio_never_switched_off']:.2f})", flush=True)
    runs = [step_times(model, copy) for _ in range(args.pairs + 1)]
    plain, constrained, serial = (statistics.median(r[k]["step_s"] for r in runs) for k in STEP_KINDS)
    fill = statistics.median(r["constrained"]["bitmask_s"] for r in runs)
    mask = statistics.median(r["constrained"]["mask_s"] for r in runs)
    structured = {"batch": 64, "plain_step_ms": 1e3 * plain, "constrained_step_ms": 1e3 * constrained,
                  "overhead": constrained / plain - 1, "bitmask_fill_ms": 1e3 * fill, "masking_ms": 1e3 * mask,
                  "masking_share_of_plain_step": mask / plain, "constrained_step_ms_fill_not_overlapped": 1e3 * serial,
                  "overhead_fill_not_overlapped": serial / plain - 1, "runs": runs}
    print(f"structured output at batch 64 (median of {len(runs)} interleaved runs): step {1e3 * plain:.2f} ms -> "
          f"{1e3 * constrained:.2f} ms ({structured['overhead']:+.1%}); bitmask fill {1e3 * fill:.2f} ms on a thread "
          f"during the forward pass, masking {1e3 * mask:.2f} ms ({mask / plain:.1%} of an unconstrained step); "
          f"fill not overlapped: {1e3 * serial:.2f} ms ({structured['overhead_fill_not_overlapped']:+.1%})")
    path = save_results("speculative", {"spec": SPEC, "rows": rows, "structured": structured,
                                        "schema": json.dumps(SCHEMA)})
    plot(rows, path.replace(".json", ".png"))
    print("saved", path)


def plot(rows: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, name in zip(axes, ("copy-heavy", "sharegpt-like")):
        rs = [r for r in rows if r["workload"] == name]
        cs = [str(r["concurrency"]) for r in rs]
        ax.plot(cs, [r["off"]["mean_token_latency_ms"] for r in rs], "o-", label="no speculation")
        ax.plot(cs, [r["on"]["mean_token_latency_ms"] for r in rs], "s-", label="n-gram speculation")
        ax.set_title(name)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("ms per output token")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
