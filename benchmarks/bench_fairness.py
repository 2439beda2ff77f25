"""Priority and per-tenant fairness (issue #69), measured: ``fcfs`` against token fairness (``fairness="tokens"``)
and the ``priority`` policy, on one replica and on two behind the Router, side by side in one run.

    python benchmarks/bench_fairness.py [--scale 1.0] [--max-num-seqs 8] [--window 10] [--windows 2]
    python benchmarks/bench_fairness.py --quick            # a smoke run: scale 0.1, 2 s windows, no results file

Every request goes through the Router's EngineClient API (``process(..., priority=, tenant=Tenant(...))`` then a
streamed ``generate``) to Ray engine-core replicas: one replica with the machine's cores, then two sharing them.
Prompts are token ids, ``ignore_eos``, greedy, from fixed seeds; ``max_num_seqs`` is small (8) so requests queue.
The **tenants** workload of shared/BENCHMARKS.md, as four scenarios:

(a) flood: tenant A sends 300 long requests at t=0 (prompts ~128 tokens, outputs ~48), tenant B 20 short interactive
    ones meanwhile (prompts ~24, outputs 16, Poisson arrivals from t=2 s, 1/s). B's TTFT p50/p95 and the total
    output tok/s under fcfs and under fairness: all of A's and B's tokens over the run's span, and (what the target
    reads) over the part of it where the flood fills every slot, before the drain's tail.
(b) backlog, equal weights: tenants C and D keep closed loops of requests outstanding (each request replaced when it
    ends; prompts ~64, outputs ~32), C four times as many as D, so fcfs serves C about 4x D. Each tenant's share of
    the tokens served (prompt tokens when its first token comes, output tokens as they come) per window after a
    warm-up, and Jain's index over C and D per window.
(c) backlog, weights C:D = 2:1 (``Tenant(weight=2.0)``), equal outstanding: the share ratio C/D per window and over
    the phase.
(d) priority (``scheduling_policy="priority"``): a priority-0 request (32-token prompt) arriving while priority-1
    requests fill every sequence slot and the KV cache (``num_gpu_blocks_override`` sized so they cannot all fit),
    against the same request on the idle engine; the difference of median TTFTs in units of the measured step time
    (wall time over the steps the replicas ran meanwhile).

fcfs and fairness run on fresh replicas with the same seeds, in alternating order (1 replica: fcfs first; 2: fairness
first). ``--scale`` multiplies the flood's request counts (A, B) and B's arrival gaps; the windows are
``--window`` seconds (10 by default, as the issue says) and ``--windows`` of them per backlog phase.

Targets (issue #69), each checked for 1 and 2 replicas: B's TTFT p95 under fairness <= 0.2x fcfs's; Jain's index
>= 0.95 for equal weights (the mean over the windows); the weighted share ratio (over the phase) within 10% of 2:1;
total out tok/s under fairness >= 0.97x fcfs's (while the flood fills every slot); the priority request's extra TTFT
at a full cache <= 2 steps (the medians). Also the figures every benchmark prints (out/total tok/s, requests/s, KV
blocks total/peak, KV waste, preemptions, MFU: the linears' FLOPs, 2 x weights per token plus the LM head per output
token, attention left out, over the fp32 matmul peak measured at the start). Writes
benchmarks/results/fairness-<machine>.{json,png}; the 1-minute load average before each run is in the JSON (the
ratios are only as good as the machine is quiet).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np
from bench_common import matmul_peak_flops, reference_model, results_path, save_results

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.engine.core_types import Tenant

POLICIES = ("fcfs", "tokens")  # what fairness= each run has; "fcfs" is fairness="none" under scheduling_policy fcfs
VOCAB = 32000


# ---- workload ---------------------------------------------------------------------------------------------------
def _lognormal(rng: np.random.Generator, n: int, mean: float, lo: int, hi: int, sigma: float = 0.5) -> list[int]:
    mu = np.log(mean) - sigma**2 / 2
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), lo, hi).astype(int).tolist()


@dataclass
class Job:
    tenant: str
    prompt: list[int]
    max_tokens: int
    at: float = 0.0  # seconds after the scenario's start


def flood_jobs(scale: float, seed: int = 0) -> list[Job]:
    """Tenant A's 300 long requests at t=0 and tenant B's 20 short ones arriving meanwhile (Poisson, 1/s from 2 s),
    both counts and B's gaps times ``scale``."""
    rng = np.random.default_rng(seed)
    n_a, n_b = max(8, round(300 * scale)), max(4, round(20 * scale))
    a_in, a_out = _lognormal(rng, n_a, 128, 32, 512), _lognormal(rng, n_a, 48, 16, 192)
    b_in = _lognormal(rng, n_b, 24, 8, 64)
    gaps = rng.exponential(1.0 * scale, n_b)
    b_at = 2.0 * min(1.0, scale * 5) + np.cumsum(gaps) - gaps[0]
    jobs = [Job("A", rng.integers(3, VOCAB, n).tolist(), o) for n, o in zip(a_in, a_out)]
    jobs += [Job("B", rng.integers(3, VOCAB, n).tolist(), 16, float(t)) for n, t in zip(b_in, b_at)]
    return jobs


class JobSource:
    """A tenant's endless supply of backlog requests (prompts ~64, outputs ~32), from its own seed."""

    def __init__(self, tenant: str, seed: int) -> None:
        self.tenant = tenant
        self.rng = np.random.default_rng(seed)

    def next(self) -> Job:
        n = _lognormal(self.rng, 1, 64, 16, 256)[0]
        return Job(self.tenant, self.rng.integers(3, VOCAB, n).tolist(), _lognormal(self.rng, 1, 32, 8, 128)[0])


# ---- one request ------------------------------------------------------------------------------------------------
@dataclass
class Rec:
    """One streamed request as the client saw it (perf_counter seconds)."""

    tenant: str
    prompt_len: int
    sent: float
    first: float | None = None
    done: float | None = None
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, new tokens)

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


_ids = iter(range(1 << 62))


async def send(engine, job: Job, weight: float = 1.0, priority: int = 0, recs: list[Rec] | None = None) -> Rec:
    params = SamplingParams(temperature=0.0, max_tokens=job.max_tokens, ignore_eos=True)
    rid = f"{job.tenant}-{next(_ids)}"
    rec = Rec(job.tenant, len(job.prompt), time.perf_counter())
    if recs is not None:
        recs.append(rec)
    _, req = await engine.process(rid, {"prompt_token_ids": job.prompt}, params, priority=priority,
                                  tenant=Tenant(job.tenant, weight))
    async for out in engine.generate(None, req, stream=True):
        now = time.perf_counter()
        n = len(out.outputs[0].token_ids)  # the router streams deltas
        if n:
            rec.first = rec.first or now
            rec.chunks.append((now, n))
        if out.finished:
            rec.done = now
    return rec


# ---- figures ------------------------------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else math.nan


def jain(xs: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n sum x^2); 1 when all equal, 1/n when one takes everything."""
    sq = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * sq) if sq else math.nan


def window_tokens(recs: list[Rec], tenants: list[str], start: float, window: float, n: int) -> list[dict[str, int]]:
    """Tokens served per tenant in each of ``n`` windows from ``start``: a request's prompt tokens when its first token
    comes (the step that ran its prompt), each output token when it comes (what the token counter charges)."""
    out = [dict.fromkeys(tenants, 0) for _ in range(n)]

    def add(t: float, tenant: str, k: int) -> None:
        i = math.floor((t - start) / window)
        if 0 <= i < n and tenant in out[i]:
            out[i][tenant] += k

    for r in recs:
        if r.first is not None:
            add(r.first, r.tenant, r.prompt_len)
        for t, k in r.chunks:
            add(t, r.tenant, k)
    return out


def shares(windows: list[dict[str, int]], weights: dict[str, float]) -> dict:
    """Per window each tenant's share, Jain's index of the weight-normalized tokens, and the first two tenants'
    ratio; the same over all the windows together."""
    names = list(weights)
    rows = []
    for w in windows + [{t: sum(x[t] for x in windows) for t in names}]:
        total = sum(w.values()) or 1
        rows.append({"tokens": w, "share": {t: w[t] / total for t in names},
                     "jain": jain([w[t] / weights[t] for t in names]),
                     "ratio": w[names[0]] / w[names[1]] if w[names[1]] else math.inf})
    per, whole = rows[:-1], rows[-1]
    return {"windows": per, "jain_mean": statistics.mean(r["jain"] for r in per),
            "jain_min": min(r["jain"] for r in per),
            "ratio_overall": whole["ratio"], "jain_overall": whole["jain"], "share_overall": whole["share"]}


async def stats_sum(engine) -> dict:
    """The replicas' scheduler counters, summed (KV blocks, peak: per replica, summed)."""
    stats = await engine.get_stats()
    s = [x.scheduler for x in stats]
    return {"t": time.perf_counter(), "steps": [x.num_steps for x in s],
            "kv_blocks_total": sum(x.kv_blocks_total for x in stats),
            "kv_blocks_peak": sum(x.peak_blocks_used for x in s), "waste_sum": sum(x.waste_sum for x in s),
            "preemptions": sum(sum(x.num_preemptions.values()) for x in s),
            "kv_usage": [x.kv_usage for x in stats], "running": [x.num_running for x in stats],
            "waiting": [x.num_waiting for x in stats]}


def engine_figures(before: dict, after: dict) -> dict:
    steps = sum(after["steps"]) - sum(before["steps"])
    return {"kv_blocks_total": after["kv_blocks_total"], "kv_blocks_peak": after["kv_blocks_peak"],
            "kv_waste": (after["waste_sum"] - before["waste_sum"]) / max(steps, 1),
            "preemptions": after["preemptions"] - before["preemptions"], "steps": steps}


def model_flops(model_dir: str) -> dict[str, float]:
    """FLOPs per token through the decoder layers' linears, and per sampled token through the LM head (attention
    and norms left out): 2 x the weights each multiplies."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    h = c["hidden_size"]
    kv = c.get("head_dim", h // c["num_attention_heads"]) * c["num_key_value_heads"]
    layer = h * (h + 2 * kv) + h * h + 3 * h * c["intermediate_size"]
    return {"per_token": 2.0 * c["num_hidden_layers"] * layer, "per_output_token": 2.0 * h * c["vocab_size"]}


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


# ---- scenarios ----------------------------------------------------------------------------------------------------
async def flood(engine, jobs: list[Job], slots: int) -> dict:
    """(a): A's requests all at once, B's at their times; every request runs to its end. Throughput over the whole
    span, and while the flood fills every slot: up to the completion that leaves fewer requests than ``slots``
    (the drain's tail after it depends on which requests happen to come last, under fcfs B's short ones)."""
    before = await stats_sum(engine)
    recs: list[Rec] = []
    t0 = time.perf_counter()

    async def later(job: Job) -> Rec:
        await asyncio.sleep(max(0.0, t0 + job.at - time.perf_counter()))
        return await send(engine, job, recs=recs)

    await asyncio.gather(*[later(j) for j in jobs])
    after = await stats_sum(engine)
    span = max(r.done for r in recs) - t0
    sat_end = sorted(r.done for r in recs)[len(recs) - slots]
    sat_tokens = sum(k for r in recs for t, k in r.chunks if t <= sat_end)
    out_tokens = sum(r.output_tokens for r in recs)
    assert out_tokens == sum(j.max_tokens for j in jobs), "a request ended short"
    b = [r.ttft for r in recs if r.tenant == "B"]
    a = [r.ttft for r in recs if r.tenant == "A"]
    last_a = max(r.done for r in recs if r.tenant == "A")
    return {"seconds": span, "output_tokens": out_tokens, "output_tok_s": out_tokens / span,
            "total_tok_s": (out_tokens + sum(r.prompt_len for r in recs)) / span, "requests_s": len(recs) / span,
            "b_ttft_s": {"p50": percentile(b, 50), "p95": percentile(b, 95), "max": max(b), "all": sorted(b)},
            "a_ttft_s": {"p50": percentile(a, 50), "p95": percentile(a, 95)},
            "b_all_sent_before_a_ended": max(r.sent for r in recs if r.tenant == "B") < last_a,
            "saturated": {"seconds": sat_end - t0, "output_tok_s": sat_tokens / (sat_end - t0)},
            **engine_figures(before, after)}


async def backlog(engine, outstanding: dict[str, int], weights: dict[str, float], warmup: float, window: float,
                  n_windows: int, seed: int) -> dict:
    """(b)/(c): each tenant keeps ``outstanding`` requests in flight (closed loops, started in a seeded interleaved
    order) for warm-up + windows, then everything still running is cancelled (the router aborts it)."""
    recs: list[Rec] = []
    sources = {t: JobSource(t, seed + i) for i, t in enumerate(outstanding)}
    t0 = time.perf_counter()
    end = t0 + warmup + window * n_windows

    async def loop(tenant: str) -> None:
        while time.perf_counter() < end:
            await send(engine, sources[tenant].next(), weights[tenant], recs=recs)

    order = [t for t, k in outstanding.items() for _ in range(k)]
    random.Random(seed).shuffle(order)
    tasks = [asyncio.ensure_future(loop(t)) for t in order]
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(0.5)  # the aborts reach the replicas
    names = list(weights)
    result = shares(window_tokens(recs, names, t0 + warmup, window, n_windows), weights)
    tokens = sum(sum(w["tokens"].values()) for w in result["windows"])
    return {"outstanding": outstanding, "weights": weights, "tok_s": tokens / (window * n_windows), **result}


async def priority_probe(engine, slots: int, probes: int, settle: float, seed: int) -> dict:
    """(d): the probe (priority 0) on the idle engine, then while priority-1 closed loops (2x the slots, long
    outputs) keep every slot and the KV cache full; TTFT medians and the step time over the loaded probes."""
    rng = np.random.default_rng(seed)
    gap = random.Random(seed)

    def probe_job() -> Job:
        return Job("P", rng.integers(3, VOCAB, 32).tolist(), 4)

    await send(engine, probe_job())  # warm
    idle = []
    for _ in range(probes):
        idle.append((await send(engine, probe_job())).ttft)
        await asyncio.sleep(0.2)
    load_src = JobSource("L", seed + 7)
    stop = asyncio.Event()
    recs: list[Rec] = []

    async def loop() -> None:
        while not stop.is_set():
            job = load_src.next()
            job.prompt = (job.prompt * 4)[:224]  # 14 blocks, outputs long enough to hold them
            job.max_tokens = 256
            await send(engine, job, priority=1, recs=recs)

    tasks = [asyncio.ensure_future(loop()) for _ in range(2 * slots)]
    await asyncio.sleep(settle)
    before = await stats_sum(engine)
    full, states = [], []
    for _ in range(probes):
        st = await stats_sum(engine)
        states.append({k: st[k] for k in ("kv_usage", "running", "waiting")})
        full.append((await send(engine, probe_job(), priority=0)).ttft)
        await asyncio.sleep(gap.uniform(0.3, 0.8))
    after = await stats_sum(engine)
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(0.5)
    per_replica = [(after["t"] - before["t"]) / max(1, a - b) for a, b in zip(after["steps"], before["steps"])]
    step = statistics.mean(per_replica)
    itl = [t2 - t1 for r in recs for (t1, _), (t2, _) in zip(r.chunks, r.chunks[1:])
           if before["t"] <= t1 and t2 <= after["t"]]
    extra = statistics.median(full) - statistics.median(idle)
    return {"ttft_idle_s": {"median": statistics.median(idle), "all": idle},
            "ttft_full_s": {"median": statistics.median(full), "max": max(full), "all": full},
            "step_s": step, "step_s_per_replica": per_replica, "itl_load_p50_s": percentile(itl, 50),
            "extra_steps": extra / step, "extra_steps_worst": (max(full) - statistics.median(idle)) / step,
            "states_at_probe": states, "preemptions": after["preemptions"] - before["preemptions"]}


# ---- replicas ---------------------------------------------------------------------------------------------------
async def on_replicas(args, n: int, scenario):
    """Launch ``n`` replicas with ``args``, run ``await scenario(router)``, shut them down."""
    from pagedserve.cluster.runtime.replicas import launch_replicas, shutdown_replicas
    from pagedserve.cluster.runtime.router import ReplicaRouter

    replicas = await asyncio.to_thread(launch_replicas, args, n)
    router = None
    try:
        infos = await asyncio.gather(*[r.actor.get_info.remote() for r in replicas])
        router = ReplicaRouter(replicas, None, infos)
        router.start()
        return await scenario(router)
    finally:
        if router is not None:
            await router.close()
        await asyncio.to_thread(shutdown_replicas, replicas)


def engine_args(model: str, max_num_seqs: int, **kw):
    from pagedserve.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, skip_tokenizer_init=True, seed=0, max_num_seqs=max_num_seqs, **kw)


# ---- targets, report, plot -------------------------------------------------------------------------------------
def verdict(by_replicas: dict[str, dict]) -> list[dict]:
    rows = []
    for n, r in by_replicas.items():
        fl, bl = r["flood"], r["backlog"]
        rows += [
            {"target": "B TTFT p95, fairness / fcfs <= 0.2", "replicas": int(n), "value": fl["ratios"]["b_ttft_p95"],
             "met": fl["ratios"]["b_ttft_p95"] <= 0.2},
            {"target": "Jain's index, equal weights >= 0.95", "replicas": int(n),
             "value": bl["equal"]["tokens"]["jain_mean"], "met": bl["equal"]["tokens"]["jain_mean"] >= 0.95},
            {"target": "share ratio C/D, weights 2:1, within 10% of 2", "replicas": int(n),
             "value": bl["weighted"]["tokens"]["ratio_overall"],
             "met": abs(bl["weighted"]["tokens"]["ratio_overall"] / 2 - 1) <= 0.1},
            {"target": "out tok/s while the flood fills the slots, fairness / fcfs >= 0.97", "replicas": int(n),
             "value": fl["ratios"]["output_tok_s"],
             "met": fl["ratios"]["output_tok_s"] >= 0.97},
            {"target": "priority-0 TTFT at a full cache - idle <= 2 steps", "replicas": int(n),
             "value": r["priority"]["extra_steps"], "met": r["priority"]["extra_steps"] <= 2.0},
        ]
    return rows


def report(by_replicas: dict[str, dict], targets: list[dict]) -> None:
    for n, r in by_replicas.items():
        print(f"\n== {n} replica(s) ==")
        for pol in POLICIES:
            f = r["flood"][pol]
            print(f"flood {pol:6s}: B TTFT p50 {f['b_ttft_s']['p50']:7.2f} s  p95 {f['b_ttft_s']['p95']:7.2f} s | "
                  f"A TTFT p50 {f['a_ttft_s']['p50']:6.1f} s | {f['output_tok_s']:6.1f} out tok/s, "
                  f"{f['total_tok_s']:7.1f} total tok/s, {f['requests_s']:5.2f} req/s, {f['seconds']:5.1f} s "
                  f"({f['saturated']['output_tok_s']:6.1f} out tok/s over the {f['saturated']['seconds']:.1f} s "
                  "with every slot full) | "
                  f"KV blocks {f['kv_blocks_total']} (peak {f['kv_blocks_peak']}), waste {f['kv_waste']:.1%}, "
                  f"{f['preemptions']} preemptions, MFU {f['mfu']:.1%}")
        pairs = [p["ratios"] for p in r["flood"]["pairs"]]

        def per_pair(key: str, pairs=pairs) -> str:
            return ", ".join(f"{p[key]:.3f}" for p in pairs)

        print(f"flood, fairness / fcfs per pair: out tok/s {per_pair('output_tok_s')}; engine steps fcfs / fairness "
              f"{per_pair('steps')} (the throughput ratio at equal cost per step); B TTFT p95 {per_pair('b_ttft_p95')}")
        for phase in ("equal", "weighted"):
            for pol in POLICIES:
                b = r["backlog"][phase][pol]
                cells = " ".join(f"{w['share'][next(iter(b['weights']))]:.2f}" for w in b["windows"])
                print(f"backlog {phase:8s} {pol:6s}: C's share per window {cells} | Jain mean {b['jain_mean']:.3f} "
                      f"(min {b['jain_min']:.3f}) | C/D {b['ratio_overall']:.2f} | {b['tok_s']:.0f} tok/s")
        p = r["priority"]
        print(f"priority: TTFT idle {p['ttft_idle_s']['median'] * 1e3:.0f} ms, at a full cache "
              f"{p['ttft_full_s']['median'] * 1e3:.0f} ms (worst {p['ttft_full_s']['max'] * 1e3:.0f}); step "
              f"{p['step_s'] * 1e3:.0f} ms (ITL p50 {p['itl_load_p50_s'] * 1e3:.0f} ms): +{p['extra_steps']:.2f} steps "
              f"(worst +{p['extra_steps_worst']:.2f}), {p['preemptions']} preemptions meanwhile")
    print("\n| target | replicas | value | met |\n|---|---|---|---|")
    for t in targets:
        print(f"| {t['target']} | {t['replicas']} | {t['value']:.3f} | {'PASS' if t['met'] else 'FAIL'} |")


def plot(by_replicas: dict[str, dict], path: str, window: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    styles = {"fcfs": "--", "tokens": "-"}
    colors = {"1": "tab:blue", "2": "tab:orange"}
    for n, r in by_replicas.items():
        for pol in POLICIES:
            xs = r["flood"][pol]["b_ttft_s"]["all"]
            axes[0].step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", ls=styles[pol], color=colors[n],
                         label=f"{n} replica{'s' if n != '1' else ''}, {pol}")
            for ax, phase in ((axes[1], "equal"), (axes[2], "weighted")):
                b = r["backlog"][phase][pol]
                c = next(iter(b["weights"]))
                mids = [(i + 0.5) * window for i in range(len(b["windows"]))]  # from the warm-up's end
                ax.plot(mids, [w["share"][c] for w in b["windows"]], "o" + styles[pol], color=colors[n],
                        label=f"{n} rep., {pol}")
    axes[0].set_xscale("log")
    axes[0].set(title="(a) tenant B's TTFT CDF under A's flood", xlabel="TTFT (s)", ylabel="fraction of B's requests")
    axes[1].axhline(0.5, color="k", lw=0.8)
    axes[1].set(title="(b) C's token share, C:D outstanding 4:1, equal weights",
                xlabel="window's middle (s after the warm-up)", ylabel="C's share", ylim=(0, 1))
    axes[2].axhline(2 / 3, color="k", lw=0.8)
    axes[2].set(title="(c) C's token share, weights C:D = 2:1", xlabel="window's middle (s after the warm-up)",
                ylabel="C's share",
                ylim=(0, 1))
    ns = list(by_replicas)
    extra = [by_replicas[n]["priority"]["extra_steps"] for n in ns]
    axes[3].bar([f"{n} replica{'s' if n != '1' else ''}" for n in ns], extra, color=[colors[n] for n in ns])
    axes[3].axhline(2, color="k", ls="--", lw=0.8, label="target: 2 steps")
    axes[3].set(title="(d) priority-0 TTFT at a full cache - idle", ylabel="steps")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- main -----------------------------------------------------------------------------------------------------------
def flood_ratios(fcfs: dict, tokens: dict) -> dict:
    """Fairness over fcfs on one flood pair. ``steps``: fcfs's engine steps over fairness's, the throughput ratio
    if every step cost the same (what the machine's load cannot move)."""
    return {"b_ttft_p50": tokens["b_ttft_s"]["p50"] / fcfs["b_ttft_s"]["p50"],
            "b_ttft_p95": tokens["b_ttft_s"]["p95"] / fcfs["b_ttft_s"]["p95"],
            "output_tok_s": tokens["saturated"]["output_tok_s"] / fcfs["saturated"]["output_tok_s"],
            "output_tok_s_full_span": tokens["output_tok_s"] / fcfs["output_tok_s"],
            "steps": fcfs["steps"] / tokens["steps"]}


async def run_replicas(model: str, n: int, ns, order: tuple[str, ...], flops: dict) -> dict:
    """Everything on ``n`` replicas: per pair, fcfs and fairness (each on fresh replicas, the order flipping each
    pair) run the flood, the first pair the backlogs too; then the priority probe."""
    S = ns.max_num_seqs * n
    jobs = flood_jobs(ns.scale, ns.seed)
    out: dict = {"flood": {"pairs": []}, "backlog": {"equal": {}, "weighted": {}}, "loadavg_1min_before": [],
                 "order": []}
    for pair in range(ns.pairs):
        runs = {}
        for pol in order if pair % 2 == 0 else order[::-1]:
            async def scenario(engine, pol=pol, runs=runs, pair=pair) -> None:
                t = time.perf_counter()
                out["order"].append(pol)
                out["loadavg_1min_before"].append(loadavg())
                runs[pol] = f = await flood(engine, jobs, S)
                f["mfu"] = (flops["per_token"] * f["total_tok_s"] + flops["per_output_token"] * f["output_tok_s"]) \
                    / flops["peak"]
                print(f"  {n} replica(s), {pol}: flood {f['seconds']:.1f} s, B TTFT p95 {f['b_ttft_s']['p95']:.2f} s, "
                      f"{f['output_tok_s']:.1f} out tok/s, {f['steps']} steps (load average {loadavg():.1f})",
                      flush=True)
                if pair:
                    return
                out["backlog"]["equal"][pol] = await backlog(engine, {"C": 4 * S, "D": S}, {"C": 1.0, "D": 1.0},
                                                             ns.warmup, ns.window, ns.windows, ns.seed + 100)
                out["backlog"]["weighted"][pol] = await backlog(engine, {"C": 2 * S, "D": 2 * S},
                                                                {"C": 2.0, "D": 1.0}, ns.warmup, ns.window,
                                                                ns.windows, ns.seed + 200)
                print(f"  {n} replica(s), {pol}: backlogs done ({time.perf_counter() - t:.0f} s in all)", flush=True)

            await on_replicas(engine_args(model, ns.max_num_seqs, fairness="none" if pol == "fcfs" else "tokens"), n,
                              scenario)
        if pair == 0:
            out["flood"].update(runs)  # the first pair's runs in full (B's TTFTs for the plot)
        out["flood"]["pairs"].append({"ratios": flood_ratios(runs["fcfs"], runs["tokens"]),
                                      "seconds": {p: r["seconds"] for p, r in runs.items()},
                                      "steps": {p: r["steps"] for p, r in runs.items()}})
    ratios = [p["ratios"] for p in out["flood"]["pairs"]]
    out["flood"]["ratios"] = {k: statistics.median(r[k] for r in ratios) for k in ratios[0]}  # median of the pairs

    async def prio(engine) -> dict:
        out["loadavg_1min_before"].append(loadavg())
        out["order"].append("priority")
        return await priority_probe(engine, S, ns.probes, ns.settle, ns.seed + 300)

    # Each replica's cache holds fewer of the load's requests (14-block prompts, 256 outputs) than it has slots.
    out["priority"] = await on_replicas(engine_args(model, ns.max_num_seqs, scheduling_policy="priority",
                                                    num_gpu_blocks_override=16 * ns.max_num_seqs), n, prio)
    print(f"  {n} replica(s), priority: +{out['priority']['extra_steps']:.2f} steps", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench-llama-58m", help="a reference model's name, or a model dir")
    ap.add_argument("--scale", type=float, default=1.0, help="times the flood's request counts (300 A, 20 B)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--window", type=float, default=10.0, help="seconds per share window")
    ap.add_argument("--windows", type=int, default=2, help="windows per backlog phase (after --warmup)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of each backlog phase before the windows")
    ap.add_argument("--probes", type=int, default=8, help="priority-0 probes, idle and at a full cache")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds of priority-1 load before the probes")
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--pairs", type=int, default=1,
                    help="fcfs/fairness pairs of the flood (each on fresh replicas, alternating); the ratios are the "
                         "pairs' medians. More pairs for a machine whose load moves the throughput")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: scale 0.1, 2 s windows (2 of them, 1 s warm-up), 3 probes; saves nothing")
    ap.add_argument("--out", default="fairness", help="results name: results/<out>-<machine>.{json,png}")
    ns = ap.parse_args(argv)
    if ns.quick:
        ns.scale, ns.window, ns.windows, ns.warmup, ns.probes, ns.settle = 0.1, 2.0, 2, 1.0, 3, 1.5
    from pagedserve.engine.executor.ray_utils import ensure_ray

    model = ns.model if os.path.isdir(ns.model) else reference_model(ns.model)
    flops = {"peak": matmul_peak_flops(), **model_flops(model)}
    jobs = flood_jobs(ns.scale, ns.seed)
    print(f"{ns.model}: scale {ns.scale} ({sum(j.tenant == 'A' for j in jobs)} A + {sum(j.tenant == 'B' for j in jobs)}"
          f" B requests), max_num_seqs {ns.max_num_seqs}, windows {ns.windows} x {ns.window:g} s after {ns.warmup:g} s,"
          f" {ns.probes} probes; replicas {ns.replicas}; fp32 matmul peak {flops['peak'] / 1e9:.0f} GFLOP/s",
          flush=True)
    ensure_ray()
    t = time.perf_counter()
    by_replicas = {}
    for i, n in enumerate(ns.replicas):
        order = POLICIES if i % 2 == 0 else POLICIES[::-1]
        by_replicas[str(n)] = asyncio.run(run_replicas(model, n, ns, order, flops))
    targets = verdict(by_replicas)
    report(by_replicas, targets)
    elapsed = time.perf_counter() - t
    print(f"\n{elapsed:.0f} s in all")
    result = {"model": ns.model, "dtype": "float32", "scale": ns.scale, "quick": ns.quick,
              "settings": {k: getattr(ns, k) for k in ("max_num_seqs", "window", "windows", "warmup", "probes",
                                                       "settle", "seed", "replicas", "pairs")},
              "flood_requests": {"A": sum(j.tenant == "A" for j in jobs), "B": sum(j.tenant == "B" for j in jobs)},
              "matmul_peak_flops": flops["peak"], "seconds": elapsed, "replicas": by_replicas, "targets": targets,
              "all_met": all(t["met"] for t in targets)}
    if not ns.quick:
        print("saved", save_results(ns.out, result))
        png = results_path(ns.out, "png")
        plot(by_replicas, png, ns.window)
        print("saved", png)
    return result


if __name__ == "__main__":
    main()
