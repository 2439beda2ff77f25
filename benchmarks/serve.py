"""Online serving over gRPC: the serving workload of ../shared/BENCHMARKS.md against a running `pagedserve serve`.

    python benchmarks/serve.py [--model bench-llama-58m] [--num-prompts 100] [--rates 1 2 4 inf] [--pairs 3]
                               [--prometheus]

Starts `pagedserve serve` as its own process (Ray, engine-core actor, gateway), sends the sharegpt-like requests as
token ids with Poisson arrivals at each rate (and all at once for `inf`), and measures with vLLM's `bench serve`
definitions: TTFT, TPOT (first token excluded), ITL (every gap between streamed chunks) and end-to-end latency
(mean, p50, p90, p99), request and output-token throughput. The client runs on uvloop, as a load generator should.

The gateway's overhead is measured at infinite rate as the median of --pairs back-to-back pairs, each the same
requests (fresh token ids per pair) over gRPC and then through the offline `LLM` in this process. This machine's
speed drifts by several percent within minutes, so only runs side by side are compared. Before the server starts,
as many pairs of engine-core actor over Ray (no gateway) and offline split the loss between the two.
With --prometheus, a local Prometheus scrapes the gateway during the run and the dashboard's key panels are
rendered to deploy/grafana/dashboard.png. Results: benchmarks/results/serve.{json,png}.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import uvloop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REFERENCE_MODELS, RESULTS, Workload, make_workload, reference_model, save_results

from pagedserve.cluster.client import AsyncClient, Client
from pagedserve.tests.server_thread import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class RequestTiming:
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival time of every response that carried tokens
    output_tokens: int = 0
    cached_prompt_tokens: int = 0
    error: str | None = None


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    a = np.asarray(xs) * 1e3  # ms
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def summarize(timings: list[RequestTiming], rate: float) -> dict:
    ok = [t for t in timings if t.error is None and t.chunks]
    start = min(t.sent for t in timings)
    duration = max(t.chunks[-1] for t in ok) - start
    ttft = [t.chunks[0] - t.sent for t in ok]
    tpot = [(t.chunks[-1] - t.chunks[0]) / (t.output_tokens - 1) for t in ok if t.output_tokens > 1]
    itl = [b - a for t in ok for a, b in zip(t.chunks, t.chunks[1:])]
    out_tokens = sum(t.output_tokens for t in ok)
    return {"rate": rate, "completed": len(ok), "failed": len(timings) - len(ok), "duration_s": duration,
            "cached_prompt_tokens": sum(t.cached_prompt_tokens for t in ok),
            "request_throughput": len(ok) / duration, "output_tok_s": out_tokens / duration,
            "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot), "itl_ms": percentiles(itl),
            "e2e_ms": percentiles([t.chunks[-1] - t.sent for t in ok])}


async def run_rate(target: str, wl: Workload, rate: float, seed: int = 0) -> list[RequestTiming]:
    """Send every request of ``wl`` with Poisson arrivals at ``rate`` requests/s (inf: all at once)."""
    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(wl.prompts)) if math.isinf(rate) else rng.exponential(1.0 / rate, len(wl.prompts))
    timings = [RequestTiming(0.0) for _ in wl.prompts]

    async def one(i: int, client: AsyncClient) -> None:
        t = timings[i]
        t.sent = time.perf_counter()
        try:
            async for resp in client.stream(wl.prompts[i], max_tokens=wl.output_lens[i], temperature=0.0,
                                            ignore_eos=True):
                n = sum(len(c.token_ids) for c in resp.completions)
                if n:
                    t.chunks.append(time.perf_counter())
                    t.output_tokens += n
                if resp.HasField("usage"):
                    t.cached_prompt_tokens = resp.usage.cached_prompt_tokens
        except Exception as e:  # recorded, counted as failed
            t.error = repr(e)

    async with AsyncClient(target) as client:
        tasks = []
        for i, gap in enumerate(gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(i, client)))
        await asyncio.gather(*tasks)
    return timings


def fresh_tokens(wl: Workload, seed: int, vocab: int = 32000) -> Workload:
    """The same prompt and output lengths with new random token ids: each rate's run gets prompts the server's
    prefix cache has not seen (it is on by default), so no run is faster for following another."""
    rng = np.random.default_rng(seed)
    return Workload(wl.name, [rng.integers(3, vocab, len(p)).tolist() for p in wl.prompts], wl.output_lens)


def report(s: dict) -> None:
    print(f"rate {s['rate']:>4} req/s: {s['request_throughput']:.2f} req/s, {s['output_tok_s']:.1f} out tok/s, "
          f"TTFT p50 {s['ttft_ms']['p50']:.0f} p99 {s['ttft_ms']['p99']:.0f} ms, "
          f"TPOT p50 {s['tpot_ms']['p50']:.1f} ms, ITL p50 {s['itl_ms']['p50']:.1f} p99 {s['itl_ms']['p99']:.1f} ms, "
          f"E2E p50 {s['e2e_ms']['p50'] / 1e3:.1f} s, failed {s['failed']}")


class Offline:
    """The same requests through the in-process offline engine (with detokenization, as the gateway does)."""

    def __init__(self, model_dir: str, max_num_seqs: int, device: str) -> None:
        from pagedserve import LLM

        self.llm = LLM(model_dir, max_num_seqs=max_num_seqs, device=device)

    def run(self, wl: Workload) -> float:
        """Output tokens/s."""
        from pagedserve import SamplingParams

        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
        t = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=False)
        dt = time.perf_counter() - t
        assert [len(o.outputs[0].token_ids) for o in outs] == wl.output_lens
        return wl.num_output_tokens / dt


def actor_direct_pairs(model_dir: str, wl: Workload, max_num_seqs: int, device: str, offline: Offline,
                       pairs: int) -> list[dict]:
    """The requests straight into an engine-core actor (this process's own Ray instance) and its output stream, no
    gateway, each run followed by the offline engine on the same requests."""
    import ray

    from pagedserve import SamplingParams
    from pagedserve.cluster.runtime.replicas import launch_replicas, shutdown_replicas
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.input_processor import InputProcessor

    ray.init(log_to_driver=False, include_dashboard=False)
    replicas = launch_replicas(EngineArgs(model=model_dir, max_num_seqs=max_num_seqs, device=device))
    actor = replicas[0].actor
    processor = InputProcessor(None, ray.get(actor.get_info.remote()))

    async def go(w: Workload, k: int) -> float:
        client = f"bench{k}"
        requests = [processor.process(f"{k}-{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[1]
                    for i, (p, n) in enumerate(zip(w.prompts, w.output_lens))]
        stream = actor.output_stream.options(num_returns="streaming").remote(client)
        t = time.perf_counter()
        await asyncio.gather(*[actor.add_request.remote(client, r) for r in requests])
        finished = 0
        async for ref in stream:
            finished += sum(out.finished for out in await ref)
            if finished == len(w.prompts):
                return w.num_output_tokens / (time.perf_counter() - t)

    out = []
    try:
        for k in range(pairs):
            w = fresh_tokens(wl, 200 + k)
            out.append({"actor_direct_output_tok_s": uvloop.run(go(w, k)), "offline_output_tok_s": offline.run(w)})
            print(f"  pair {k}: engine-core actor {out[-1]['actor_direct_output_tok_s']:.1f}, "
                  f"offline {out[-1]['offline_output_tok_s']:.1f} out tok/s")
    finally:
        shutdown_replicas(replicas)
        ray.shutdown()
    return out


def median_loss(pairs: list[dict], key: str) -> dict:
    losses = [1 - p[key] / p["offline_output_tok_s"] for p in pairs]
    return {"median": statistics.median(losses), "min": min(losses), "max": max(losses)}


class Server:
    """`pagedserve serve` in its own process group (it starts its own Ray instance)."""

    def __init__(self, model_dir: str, max_num_seqs: int, device: str, log_path: str) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        exe = os.path.join(os.path.dirname(sys.executable), "pagedserve")
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [exe, "serve", "--model", model_dir, "--host", "127.0.0.1", "--port", str(self.port),
             "--metrics-port", str(self.metrics_port), "--max-num-seqs", str(max_num_seqs), "--device", device],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 300.0) -> None:
        def alive() -> None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pagedserve serve exited with {self.proc.returncode}; see {self.log.name}")

        with Client(self.target, timeout=2) as c:
            c.wait_for_health("SERVING", timeout, poll=0.5, check=alive)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # graceful drain, then Ray shuts down
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-llama-58m", choices=sorted(REFERENCE_MODELS))
    ap.add_argument("--num-prompts", type=int, default=100, help="the first N sharegpt-like requests")
    ap.add_argument("--rates", nargs="+", type=float, default=[1.0, 2.0, 4.0, math.inf],
                    help="Poisson request rates in requests/s; inf sends all at t=0")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--prometheus", action="store_true",
                    help="scrape the gateway with a local Prometheus and render deploy/grafana/dashboard.png")
    ap.add_argument("--pairs", type=int, default=3, help="side-by-side runs for each overhead ratio")
    ap.add_argument("--out", default="serve", help="results file name (under benchmarks/results/)")
    args = ap.parse_args()

    model_dir = reference_model(args.model)
    full = make_workload("sharegpt")
    wl = Workload("sharegpt", full.prompts[: args.num_prompts], full.output_lens[: args.num_prompts])
    print(f"{args.model}, {len(wl.prompts)} sharegpt-like requests: {wl.num_prompt_tokens} prompt + "
          f"{wl.num_output_tokens} output tokens")

    offline = Offline(model_dir, args.max_num_seqs, args.device)
    offline.run(fresh_tokens(Workload("warmup", wl.prompts[:4], [8] * 4), 1))
    print(f"engine-core actor over Ray without the gateway vs offline, {args.pairs} pairs:")
    direct = actor_direct_pairs(model_dir, wl, args.max_num_seqs, args.device, offline, args.pairs)

    log = os.path.join(tempfile.gettempdir(), f"{args.out}-server.log")
    server = Server(model_dir, args.max_num_seqs, args.device, log)
    prom = None
    grpc_pairs = []
    try:
        server.wait_ready()
        if args.prometheus:
            from pagedserve.tests.promql import LocalPrometheus

            prom = LocalPrometheus([f"127.0.0.1:{server.metrics_port}"], tempfile.mkdtemp(prefix="prom"),
                                   scrape_interval="1s").start()
        warm = fresh_tokens(wl, 10_000)
        uvloop.run(run_rate(server.target, Workload("warmup", warm.prompts[:4], [8] * 4), math.inf))
        t_start = time.time()
        runs = []
        for i, rate in enumerate(args.rates):
            runs.append(summarize(uvloop.run(run_rate(server.target, fresh_tokens(wl, i + 1), rate)), rate))
            report(runs[-1])
        t_end = time.time()
        if prom is not None:
            time.sleep(3)  # the last scrapes
            sys.path.insert(0, os.path.join(REPO, "deploy", "grafana"))
            from render_dashboard import render

            print("dashboard:", render(prom.url, t_start - 5, t_end + 3, 1.0, 1.0,
                                       os.path.join(REPO, "deploy", "grafana", "dashboard.png"), rate_window="6s"))
            prom.stop()
            prom = None
        print(f"gRPC at infinite rate (no Prometheus) vs offline, {args.pairs} pairs:")
        for k in range(args.pairs):
            w = fresh_tokens(wl, 100 + k)
            res = summarize(uvloop.run(run_rate(server.target, w, math.inf)), math.inf)
            grpc_pairs.append({"grpc_output_tok_s": res["output_tok_s"], "offline_output_tok_s": offline.run(w),
                               "grpc_failed": res["failed"]})
            print(f"  pair {k}: gRPC {res['output_tok_s']:.1f}, offline {grpc_pairs[-1]['offline_output_tok_s']:.1f} "
                  f"out tok/s")
    finally:
        if prom is not None:
            prom.stop()
        server.stop()
    total, actor = median_loss(grpc_pairs, "grpc_output_tok_s"), median_loss(direct, "actor_direct_output_tok_s")
    overhead = {"pairs": args.pairs, "grpc_vs_offline": grpc_pairs, "actor_direct_vs_offline": direct,
                "throughput_loss": total, "ray_actor_loss": actor,
                # what the gateway and gRPC add on top of the Ray-hosted engine
                "gateway_loss": 1 - (1 - total["median"]) / (1 - actor["median"])}
    print(f"gateway overhead at infinite rate: gRPC loses {total['median']:.1%} of the offline engine's output "
          f"throughput (median of {args.pairs} pairs, {total['min']:.1%} .. {total['max']:.1%}); the engine in a Ray "
          f"actor without the gateway loses {actor['median']:.1%} ({actor['min']:.1%} .. {actor['max']:.1%}), "
          f"so the gateway and gRPC add {overhead['gateway_loss']:.1%}")
    base = statistics.mean(p["offline_output_tok_s"] for p in grpc_pairs + direct)
    results = {"model": args.model, "device": args.device, "requests": len(wl.prompts),
               "prompt_tokens": wl.num_prompt_tokens, "output_tokens": wl.num_output_tokens,
               "offline": {"output_tok_s": base}, "runs": [dict(r, rate=str(r["rate"])) for r in runs],
               "gateway_overhead": overhead}
    print("saved", save_results(args.out, results))
    plot(results, args.out)


def plot(results: dict, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    labels = [r["rate"] for r in runs]
    x = range(len(runs))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in [(axes[0], "ttft_ms", "time to first token"), (axes[1], "tpot_ms", "time per output token")]:
        for p in ("p50", "p90", "p99"):
            ax.plot(x, [r[key][p] for r in runs], marker="o", label=p)
        ax.set_title(title)
        ax.set_ylabel("ms")
    axes[2].plot(x, [r["e2e_ms"]["p50"] / 1e3 for r in runs], marker="o", label="E2E p50 (s)")
    axes[2].plot(x, [r["e2e_ms"]["p99"] / 1e3 for r in runs], marker="o", label="E2E p99 (s)")
    axes[2].set_title("end-to-end latency")
    axes[2].set_ylabel("s")
    ax3 = axes[2].twinx()
    ax3.bar(x, [r["output_tok_s"] for r in runs], alpha=0.2, color="gray", label="out tok/s")
    ax3.axhline(results["offline"]["output_tok_s"], color="gray", ls="--", label="offline out tok/s")
    ax3.set_ylabel("output tok/s")
    ax3.legend(loc="upper left", fontsize=8)
    for ax in axes:
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("request rate (req/s)")
        ax.legend(loc="upper right" if ax is not axes[2] else "center left", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{results['model']} over gRPC, {results['requests']} sharegpt-like requests ({results['device']})")
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{name}.png"), dpi=110)


if __name__ == "__main__":
    main()
