"""Disaggregated prefill and decode against aggregated replicas on the same cores: two simulated Ray nodes
(ray.cluster_utils.Cluster) of one CPU each; aggregated ``--data-parallel-size 2`` (at each chunk size asked, the one
with the best ITL p99 kept) against ``--prefill-replicas 1 --decode-replicas 1``. Workload over the OpenAI HTTP API:
``--streams`` requests decoding long outputs, while bursts of long prompts arrive. Reports the streams' inter-token
latency p50/p99, the long prompts' TTFT p50/p99, output tok/s, goodput (output tok/s of the requests that met their
SLO: a stream's ITL p99, a long prompt's TTFT) and the KV bytes moved per handoff. Each server is then driven once
more with the streams sent by vLLM's own client (`vllm bench serve`, benchmarks/.venv-vllm: random prompts, all at
once) while this script sends the same bursts; its ITL p50/p99, TPOT and the streams' output tok/s are reported
under ``vllm_client``. Writes benchmarks/results/disagg-<cpu>.{json,png}.

    python benchmarks/bench_disagg.py [--model DIR] [--streams 16] [--bursts 6] [--burst-size 3] [--prompt-len 1536]
                                      [--no-vllm-client]

Targets (issue 68): ITL p99 <= 0.5x aggregated at >= 0.9x its output throughput.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(__file__))
import aiohttp
from bench_cluster import Served
from bench_common import reference_model, results_path, save_results
from bench_serve_vs_vllm import VLLM_PYTHON, run_client

from pagedserve.engine.arg_utils import EngineArgs


@dataclass
class Stream:
    """One streamed completion: when its first token came, and the gaps between the later ones (seconds)."""

    ttft: float
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0


async def stream(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> Stream:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    times = []
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            if line.startswith(b"data: {") and any(c.get("text") for c in json.loads(line[6:])["choices"]):
                times.append(time.perf_counter())
    return Stream(times[0] - t0, [b - a for a, b in itertools.pairwise(times)], len(times))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 1000) for _ in range(n)]


async def send_bursts(session: aiohttp.ClientSession, url: str, ns, rng: random.Random) -> list[Stream]:
    """``bursts`` bursts of ``burst_size`` long prompts, one every ``burst_every_s``."""
    bursts = []
    for _ in range(ns.bursts):
        bursts += [asyncio.ensure_future(stream(session, url, random_prompt(rng, ns.prompt_len), ns.burst_tokens))
                   for _ in range(ns.burst_size)]
        await asyncio.sleep(ns.burst_every_s)
    return list(await asyncio.gather(*bursts))


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=1200))


async def scenario(url: str, ns, seed: int = 0) -> dict:
    """The streams start; once each has its first token, a burst of long prompts arrives every ``burst_every_s``."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return random_prompt(rng, n)

    async with _session() as session:
        t0 = time.perf_counter()
        streams = [asyncio.ensure_future(stream(session, url, prompt(ns.stream_prompt_len), ns.stream_tokens))
                   for _ in range(ns.streams)]
        await asyncio.sleep(ns.burst_every_s)
        long = await send_bursts(session, url, ns, rng)
        decoded = await asyncio.gather(*streams)
        elapsed = time.perf_counter() - t0
    gaps = [g for s in decoded for g in s.gaps]
    tokens = sum(s.tokens for s in decoded + long)
    good = sum(s.tokens for s in decoded if pct(s.gaps, 0.99) <= ns.itl_slo_s) + \
        sum(s.tokens for s in long if s.ttft <= ns.ttft_slo_s)
    return {"itl_p50_s": statistics.median(gaps), "itl_p99_s": pct(gaps, 0.99),
            "ttft_p50_s": statistics.median(s.ttft for s in long), "ttft_p99_s": pct([s.ttft for s in long], 0.99),
            "output_tok_s": tokens / elapsed, "goodput_tok_s": good / elapsed, "elapsed_s": elapsed}


def vllm_client_argv(ns, model: str, url: str) -> list[str]:
    """`vllm bench serve` sending the streams: ``streams`` random prompts of ``stream_prompt_len`` tokens, all at once,
    each decoding ``stream_tokens`` (no ready check: the server is warm, and its test request would run alone)."""
    served_name = os.path.basename(os.path.normpath(model))  # the server's default name for the model
    return ["--backend", "openai", "--endpoint", "/v1/completions", "--base-url", url, "--model", served_name,
            "--tokenizer", model, "--dataset-name", "random", "--random-input-len", str(ns.stream_prompt_len),
            "--random-output-len", str(ns.stream_tokens), "--random-range-ratio", "0", "--num-prompts",
            str(ns.streams), "--max-concurrency", str(ns.streams), "--request-rate", "inf", "--ignore-eos",
            "--temperature", "0", "--ready-check-timeout-sec", "0", "--disable-tqdm", "--percentile-metrics",
            "ttft,tpot,itl", "--metric-percentiles", "50,99"]


async def scenario_vllm_client(srv: Served, ns, model: str, log_path: str) -> dict:
    """The streams sent by vLLM's client; once they all run, this script's bursts."""
    client = asyncio.get_running_loop().run_in_executor(None, run_client, vllm_client_argv(ns, model, srv.url),
                                                        log_path)
    engine = srv.gateway.state.engine
    while len(engine.inflight) < ns.streams and not client.done():
        await asyncio.sleep(0.02)
    async with _session() as session:
        await asyncio.sleep(ns.burst_every_s)
        long = await send_bursts(session, srv.url, ns, random.Random(2))
    r = await client
    if r["failed"]:
        raise RuntimeError(f"vLLM's client: {r['failed']} requests failed: {r['errors']}")
    return {"itl_p50_s": r["p50_itl_ms"] / 1e3, "itl_p99_s": r["p99_itl_ms"] / 1e3,
            "tpot_mean_s": r["mean_tpot_ms"] / 1e3, "stream_output_tok_s": r["output_throughput"],
            "completed": r["completed"], "ttft_p50_s": statistics.median(s.ttft for s in long)}


def run(args: EngineArgs, port: int, ns, **opts) -> dict:
    dp = 1 if opts.get("prefill_replicas") else 2
    srv = Served(args, dp, None, port, port + 1, **opts)
    try:
        asyncio.run(scenario(srv.url, _warmup(ns), seed=1))
        res = asyncio.run(scenario(srv.url, ns))
        if ns.vllm_client:
            log = os.path.join(tempfile.gettempdir(), "bench_disagg_vllm_client.log")
            res["vllm_client"] = asyncio.run(scenario_vllm_client(srv, ns, args.model, log))
        engine = srv.gateway.state.engine
        if engine.disagg.enabled:
            st = engine.disagg.stats
            handoffs = sum(st.outcomes.values())
            res.update(handoffs=handoffs, outcomes=dict(st.outcomes), failures=dict(st.failures),
                       kv_bytes_per_handoff=st.bytes / max(1, handoffs), kv_blocks_moved=st.blocks,
                       kv_transfer_mean_s=st.seconds_sum / max(1, handoffs))
        return res
    finally:
        srv.stop()


def _warmup(ns) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(ns), "streams": 4, "bursts": 1, "burst_size": 1, "stream_tokens": 8,
                                 "burst_every_s": 0.5})


def show(name: str, r: dict) -> None:
    print(f"  {name:28s} ITL p50 {r['itl_p50_s'] * 1e3:7.1f} ms  p99 {r['itl_p99_s'] * 1e3:7.1f} ms  "
          f"TTFT p50 {r['ttft_p50_s']:6.2f} s  p99 {r['ttft_p99_s']:6.2f} s  {r['output_tok_s']:7.1f} out tok/s  "
          f"goodput {r['goodput_tok_s']:7.1f}", flush=True)
    if "vllm_client" in r:
        v = r["vllm_client"]
        print(f"  {'  (vLLM client)':28s} ITL p50 {v['itl_p50_s'] * 1e3:7.1f} ms  p99 {v['itl_p99_s'] * 1e3:7.1f} ms  "
              f"TTFT p50 {v['ttft_p50_s']:6.2f} s  streams {v['stream_output_tok_s']:7.1f} out tok/s", flush=True)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, label in zip(axes, ("itl_p99_s", "ttft_p50_s", "output_tok_s"),
                              ("streams' ITL p99 (s)", "long prompts' TTFT p50 (s)", "output tok/s")):
        ax.bar(range(len(names)), [results[n][key] for n in names])
        ax.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
        ax.set_title(label)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the reference model bench-llama-58m)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--stream-prompt-len", type=int, default=32)
    ap.add_argument("--stream-tokens", type=int, default=512)
    ap.add_argument("--bursts", type=int, default=6)
    ap.add_argument("--burst-size", type=int, default=3)
    ap.add_argument("--burst-every-s", type=float, default=1.0)
    ap.add_argument("--prompt-len", type=int, default=1536)
    ap.add_argument("--burst-tokens", type=int, default=8)
    ap.add_argument("--chunks", default="2048,256", help="aggregated: the chunk sizes (max_num_batched_tokens) tried")
    ap.add_argument("--max-local-prefill-length", type=int, default=256)
    ap.add_argument("--itl-slo-s", type=float, default=0.1)
    ap.add_argument("--ttft-slo-s", type=float, default=10.0)
    ap.add_argument("--no-vllm-client", dest="vllm_client", action="store_false",
                    help="skip the runs driven by vLLM's client")
    ns = ap.parse_args()
    if ns.vllm_client and not os.path.exists(VLLM_PYTHON):
        ap.error("vLLM's client needs benchmarks/.venv-vllm (bash benchmarks/setup_vllm_cpu.sh), or --no-vllm-client")
    import ray
    from ray.cluster_utils import Cluster

    model = ns.model or reference_model("bench-llama-58m")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    os.environ["RAY_ADDRESS"] = cluster.address
    ray.init(address=cluster.address, log_to_driver=False)
    results: dict = {}
    port = 18400
    try:
        aggregated = {}
        for chunk in map(int, ns.chunks.split(",")):
            args = EngineArgs(model=model, seed=0, block_size=16, max_num_batched_tokens=chunk, max_model_len=4096)
            aggregated[chunk] = run(args, port, ns)
            port += 2
            show(f"aggregated dp=2 chunk {chunk}", aggregated[chunk])
        best = min(aggregated, key=lambda c: aggregated[c]["itl_p99_s"])
        results["aggregated"] = {**aggregated[best], "chunk": best,
                                 "chunks": {str(c): r for c, r in aggregated.items()}}
        args = EngineArgs(model=model, seed=0, block_size=16, max_model_len=4096)
        results["1P+1D"] = run(args, port, ns, prefill_replicas=1, decode_replicas=1,
                               max_local_prefill_length=ns.max_local_prefill_length)
        show("disaggregated 1P+1D", results["1P+1D"])
    finally:
        ray.shutdown()
        cluster.shutdown()
    a, d = results["aggregated"], results["1P+1D"]
    summary = {"itl_p99_vs_aggregated": d["itl_p99_s"] / a["itl_p99_s"],
               "itl_p50_vs_aggregated": d["itl_p50_s"] / a["itl_p50_s"],
               "ttft_p50_vs_aggregated": d["ttft_p50_s"] / a["ttft_p50_s"],
               "throughput_vs_aggregated": d["output_tok_s"] / a["output_tok_s"],
               "goodput_vs_aggregated": d["goodput_tok_s"] / max(1e-9, a["goodput_tok_s"]),
               "kv_bytes_per_handoff": d.get("kv_bytes_per_handoff")}
    if ns.vllm_client:
        av, dv = a["vllm_client"], d["vllm_client"]
        summary.update(vllm_client_itl_p99_vs_aggregated=dv["itl_p99_s"] / av["itl_p99_s"],
                       vllm_client_itl_p50_vs_aggregated=dv["itl_p50_s"] / av["itl_p50_s"],
                       vllm_client_stream_tok_s_vs_aggregated=dv["stream_output_tok_s"] / av["stream_output_tok_s"])
    print(json.dumps(summary, indent=1))
    path = save_results("disagg", {"model": model, "config": vars(ns), "results": results, "summary": summary})
    plot({"aggregated (best ITL)": a, "1P+1D": d}, results_path("disagg", "png"))
    print("saved", path)


if __name__ == "__main__":
    main()
