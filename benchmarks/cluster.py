"""Routing policies side by side: two simulated Ray nodes (ray.cluster_utils.Cluster), --data-parallel-size 2, a
multi-tenant workload over the OpenAI HTTP API (each tenant's long system prompt, then short unique questions) and
one with no shared prefix. Per policy: output tok/s, TTFT p50/p99 and the cluster-wide prefix hit rate; a single
replica's hit rate on the same workload is the ceiling. Writes benchmarks/results/cluster-<cpu>.{json,png}.

    python benchmarks/cluster.py [--model DIR] [--tenants 6] [--requests 96] [--concurrency 16]

Targets (issue 33): prefix-aware >= 1.3x least-loaded output tok/s, TTFT p50 <= 0.7x, hit rate within 10% of the
ceiling; on the no-shared-prefix workload no worse than least-loaded. The KV pool is sized (--kv-blocks-per-tenant)
so one replica holds about half the tenants' prefixes: that is where routing by cache state pays.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
import httpx
from common import reference_model, results_path, save_results

from pagedserve.cluster.entrypoints.serve import ServeOptions, serve
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


class Served:
    """``serve()`` on its own loop in a thread, joined to the simulated cluster."""

    def __init__(self, args: EngineArgs, dp: int, policy: str, port: int, http_port: int) -> None:
        self.opts = ServeOptions(host="127.0.0.1", port=port, http_port=http_port, metrics_port=0,
                                 data_parallel_size=dp, routing_policy=policy)
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

    def hit_rate(self) -> float:
        import ray

        stats = [ray.get(r.actor.get_stats.remote()).scheduler for r in self.gateway.state.engine.replicas]
        return sum(s.prefix_cache_hits for s in stats) / max(1, sum(s.prefix_cache_queries for s in stats))

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(120)


async def drive(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    ttfts, tokens = [], 0

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> None:
        nonlocal tokens
        async with sem:
            t0 = time.perf_counter()
            first = None
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        first = first or time.perf_counter()
            ttfts.append(first - t0)
            tokens += max_tokens

    async with httpx.AsyncClient(timeout=600) as client:
        t = time.perf_counter()
        await asyncio.gather(*[one(client, p) for p in prompts])
        elapsed = time.perf_counter() - t
    ttfts.sort()
    return {"output_tok_s": tokens / elapsed, "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]}


def run_one(args: EngineArgs, dp: int, policy: str, prompts: list[list[int]], ns, port: int) -> dict:
    srv = Served(args, dp, policy, port, port + 1)
    try:
        asyncio.run(drive(srv.url, prompts[:ns.concurrency], ns.max_tokens, ns.concurrency))  # warm-up
        before = srv.hit_rate()
        res = asyncio.run(drive(srv.url, prompts, ns.max_tokens, ns.concurrency))
        res["prefix_hit_rate"] = srv.hit_rate()
        res["prefix_hit_rate_before_run"] = before
        print(f"  dp={dp} {policy:13s} {res['output_tok_s']:8.1f} out tok/s  TTFT p50 {res['ttft_p50_s'] * 1e3:7.1f} ms"
              f"  p99 {res['ttft_p99_s'] * 1e3:7.1f} ms  hit rate {res['prefix_hit_rate']:.2f}", flush=True)
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
    ns = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    model = ns.model or reference_model("bench-llama-58m")
    cpus = max(2, (os.cpu_count() or 2) // 2)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus})
    cluster.add_node(num_cpus=cpus)
    os.environ["RAY_ADDRESS"] = cluster.address
    ray.init(address=cluster.address, log_to_driver=False)
    block = 16
    blocks = int(ns.tenants * ns.kv_blocks_per_tenant * (ns.system_len // block)) + 4 * ns.concurrency
    args = EngineArgs(model=model, seed=0, block_size=block, num_gpu_blocks_override=blocks)
    vocab = 1000
    results: dict = {"shared": {}, "unshared": {}}
    port = 18000
    try:
        for wl, shared in (("shared", True), ("unshared", False)):
            prompts = workload(ns.tenants, ns.requests, ns.system_len, ns.question_len, vocab, shared)
            print(f"{wl} prefixes ({len(prompts)} requests):", flush=True)
            for policy in POLICIES:
                results[wl][policy] = run_one(args, 2, policy, prompts, ns, port)
                port += 2
            if shared:
                results[wl]["single-replica"] = run_one(args, 1, "least-loaded", prompts, ns, port)
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
    }
    print(summary)
    path = save_results("cluster", {"model": model, "config": vars(ns), "results": results, "summary": summary})
    plot(results, results_path("cluster", "png"))
    print("saved", path)


if __name__ == "__main__":
    main()
