"""Online serving over gRPC and HTTP: the serving workload of ../shared/BENCHMARKS.md against a running
`pagedserve serve`, and (with --vllm) the same workload over HTTP against `vllm serve` from vLLM's CPU build.

    python benchmarks/bench_serve.py [--model bench-llama-58m] [--num-prompts 100] [--rates 1 2 4 inf] [--pairs 3]
                               [--protocols grpc http] [--vllm] [--prometheus]

Starts `pagedserve serve` as its own process (Ray, engine-core actor, gateway serving gRPC and the OpenAI-compatible
HTTP API), sends the sharegpt-like requests as token ids with Poisson arrivals at each rate (and all at once for
`inf`), over gRPC (the pagedserve client) and over HTTP (streamed /v1/completions with a list-of-int prompt, read by
an aiohttp client as vLLM's `bench serve` does), and measures with vLLM's `bench serve` definitions: TTFT, TPOT
(first token excluded), ITL (every gap between streamed chunks) and end-to-end latency (mean, p50, p90, p99),
request and output-token throughput. The clients run on uvloop, as a load generator should.

The gateway's overhead is measured at infinite rate as the median of --pairs back-to-back pairs: each pair sends the
same-length requests (fresh token ids each run) over every protocol and then through the offline `LLM` in this
process. The machine's speed drifts within minutes, so only runs side by side are compared; each of those runs also
records the CPU seconds per 1k output tokens of the gateway process, the engine-core actor, the rest of Ray and the
client: what each part costs beside the engine (the drift moves these too, all alike). Before the server starts, as
many pairs of engine-core actor over Ray (no gateway) and offline split the loss.

--vllm then stops pagedserve and starts `vllm serve` (benchmarks/.venv-vllm, made by setup_vllm_cpu.sh; float32,
VLLM_CPU_KVCACHE_SPACE=4, OMP_NUM_THREADS=2, the same max_num_seqs) and runs the same rates over HTTP, for the
side-by-side table. Only one server runs at a time: both would share the same two cores.
With --prometheus, a local Prometheus scrapes the gateway during the run and the dashboard's key panels are
rendered to deploy/grafana/dashboard.png. Results: benchmarks/results/serve-<cpu>.{json,png}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
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
from bench_common import REFERENCE_MODELS, Workload, make_workload, reference_model, results_path, save_results

from pagedserve.cluster.client import AsyncClient, Client
from pagedserve.tests.server_thread import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_VENV = os.path.join(REPO, "benchmarks", ".venv-vllm")
PROTOCOLS = ("grpc", "http")


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


async def run_rate_http(base_url: str, model: str, wl: Workload, rate: float, seed: int = 0) -> list[RequestTiming]:
    """As run_rate, over HTTP: streamed POST /v1/completions, the prompt as token ids (pagedserve's API and
    vLLM's alike). A chunk's arrival counts when it carries text or tokens; the output length is the usage's."""
    import aiohttp

    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(wl.prompts)) if math.isinf(rate) else rng.exponential(1.0 / rate, len(wl.prompts))
    timings = [RequestTiming(0.0) for _ in wl.prompts]
    url = f"{base_url}/v1/completions"

    async def one(i: int, session: aiohttp.ClientSession) -> None:
        t = timings[i]
        body = {"model": model, "prompt": wl.prompts[i], "max_tokens": wl.output_lens[i], "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        t.sent = time.perf_counter()
        try:
            async with session.post(url, json=body) as resp:
                if resp.status != 200:
                    t.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        t.error = str(chunk["error"])
                        break
                    if any(c.get("text") or c.get("token_ids") for c in chunk.get("choices") or ()):
                        t.chunks.append(time.perf_counter())
                    if chunk.get("usage"):
                        t.output_tokens = chunk["usage"]["completion_tokens"]
                        details = chunk["usage"].get("prompt_tokens_details") or {}
                        t.cached_prompt_tokens = details.get("cached_tokens") or 0
        except Exception as e:  # recorded, counted as failed
            t.error = repr(e)

    connector = aiohttp.TCPConnector(limit=0)  # every request its own connection, as concurrent clients have
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = []
        for i, gap in enumerate(gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(i, session)))
        await asyncio.gather(*tasks)
    return timings


def cpu_seconds(server_pid: int) -> dict[str, float]:
    """CPU seconds used so far by the server's gateway process, its engine-core actor, the rest of its process
    tree (Ray's daemons and idle workers) and this client."""
    import psutil

    def used(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system + t.children_user + t.children_system if p.pid == os.getpid() else t.user + t.system

    server = psutil.Process(server_pid)
    parts = {"gateway": used(server), "engine": 0.0, "ray": 0.0, "client": used(psutil.Process())}
    for child in server.children(recursive=True):
        try:
            parts["engine" if "EngineCoreActor" in " ".join(child.cmdline()) else "ray"] += used(child)
        except psutil.Error:  # ended meanwhile
            pass
    return parts


def fmt_cpu(parts: dict[str, float]) -> str:
    return ", ".join(f"{part} {v:.2f}" for part, v in parts.items())


def fresh_tokens(wl: Workload, seed: int, vocab: int = 32000) -> Workload:
    """The same prompt and output lengths with new random token ids: each rate's run gets prompts the server's
    prefix cache has not seen (it is on by default), so no run is faster for following another."""
    rng = np.random.default_rng(seed)
    return Workload(wl.name, [rng.integers(3, vocab, len(p)).tolist() for p in wl.prompts], wl.output_lens)


def report(s: dict, label: str = "") -> None:
    print(f"{label:<16}rate {s['rate']:>4} req/s: {s['request_throughput']:.2f} req/s, "
          f"{s['output_tok_s']:.1f} out tok/s, "
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
            finished += sum(getattr(out, "finished", False) for out in await ref)  # skips KV events
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


def median_loss(pairs: list[dict], key: str, offline_key: str = "offline_output_tok_s") -> dict:
    losses = [1 - p[key] / p[offline_key] for p in pairs]
    return {"median": statistics.median(losses), "min": min(losses), "max": max(losses)}


class Server:
    """`pagedserve serve` in its own process group (it starts its own Ray instance), gRPC and HTTP."""

    def __init__(self, model_dir: str, max_num_seqs: int, device: str, log_path: str,
                 extra_args: tuple[str, ...] = (), extra_env: dict[str, str] | None = None) -> None:
        self.port, self.metrics_port, self.http_port = free_port(), free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.model = os.path.basename(os.path.normpath(model_dir))
        exe = os.path.join(os.path.dirname(sys.executable), "pagedserve")
        env = dict(os.environ, **(extra_env or {}))
        env.pop("RAY_ADDRESS", None)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [exe, "serve", "--model", model_dir, "--host", "127.0.0.1", "--grpc-port", str(self.port),
             "--port", str(self.http_port), "--metrics-port", str(self.metrics_port),
             "--max-num-seqs", str(max_num_seqs), "--device", device, "--enable-prompt-tokens-details",
             *extra_args],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def run(self, protocol: str, wl: Workload, rate: float) -> list[RequestTiming]:
        if protocol == "grpc":
            return uvloop.run(run_rate(self.target, wl, rate))
        return uvloop.run(run_rate_http(self.url, self.model, wl, rate))

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


def vllm_env(threads: int, kv_cache_gib: int) -> dict[str, str]:
    """vLLM's CPU-backend settings, as benchmarks/bench_vllm_driver.py sets them for the offline baseline."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), OMP_NUM_THREADS=str(threads),
               VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)), HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    libs = [os.path.join(VLLM_VENV, "lib", n) for n in ("libtcmalloc_minimal.so.4", "libiomp5.so")]
    libs = [lib for lib in libs if os.path.isfile(lib)]
    if libs:
        env["LD_PRELOAD"] = ":".join(filter(None, [*libs, os.environ.get("LD_PRELOAD", "")]))
    env.pop("RAY_ADDRESS", None)
    return env


class VllmServer:
    """`vllm serve` from vLLM's CPU build (benchmarks/.venv-vllm), float32 unless ``dtype``, in its own process
    group."""

    def __init__(self, model_dir: str, max_num_seqs: int, log_path: str, threads: int = 2,
                 kv_cache_gib: int = 4, dtype: str = "float32", extra_args: tuple[str, ...] = ()) -> None:
        python = os.path.join(VLLM_VENV, "bin", "python")
        if not os.path.isfile(python):
            raise SystemExit(f"{python} is missing: run bash benchmarks/setup_vllm_cpu.sh first")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = "bench"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            # `vllm serve`'s server, started through its module: the `vllm` command looks up the distribution
            # "vllm", and the CPU build installs as "vllm-cpu".
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
             "--port", str(self.port), "--dtype", dtype,
             "--max-num-seqs", str(max_num_seqs), "--seed", "0", "--served-model-name", self.model,
             "--disable-uvicorn-access-log", "--disable-log-stats", *extra_args],
            stdout=self.log, stderr=subprocess.STDOUT, env=vllm_env(threads, kv_cache_gib), start_new_session=True,
            cwd=tempfile.gettempdir())  # not the repo root: its kernels/ would shadow the `kernels` package

    def wait_ready(self, timeout: float = 900.0) -> None:
        """vLLM compiles the model for CPU at start-up: minutes, not seconds."""
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not ready after {timeout:.0f} s; see {self.log.name}")
            time.sleep(1.0)

    def run(self, wl: Workload, rate: float) -> list[RequestTiming]:
        return uvloop.run(run_rate_http(self.url, self.model, wl, rate))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def warm_up(run, wl: Workload) -> None:
    warm = fresh_tokens(wl, 10_000)
    run(Workload("warmup", warm.prompts[:4], [8] * 4), math.inf)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-llama-58m", choices=sorted(REFERENCE_MODELS))
    ap.add_argument("--num-prompts", type=int, default=100, help="the first N sharegpt-like requests")
    ap.add_argument("--rates", nargs="+", type=float, default=[1.0, 2.0, 4.0, math.inf],
                    help="Poisson request rates in requests/s; inf sends all at t=0")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--protocols", nargs="+", default=list(PROTOCOLS), choices=PROTOCOLS)
    ap.add_argument("--vllm", action="store_true", help="then the same rates over HTTP against `vllm serve`")
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
    runs: dict[str, list[dict]] = {p: [] for p in args.protocols}
    pairs = []
    try:
        server.wait_ready()
        if args.prometheus:
            from pagedserve.tests.promql import LocalPrometheus

            prom = LocalPrometheus([f"127.0.0.1:{server.metrics_port}"], tempfile.mkdtemp(prefix="prom"),
                                   scrape_interval="1s").start()
        for protocol in args.protocols:
            warm_up(lambda w, r, p=protocol: server.run(p, w, r), wl)
        t_start = time.time()
        for i, rate in enumerate(args.rates):
            for k, protocol in enumerate(args.protocols):  # fresh token ids per run: no run hits another's cache
                runs[protocol].append(summarize(server.run(protocol, fresh_tokens(wl, 1 + i + 1000 * k), rate), rate))
                report(runs[protocol][-1], f"pagedserve {protocol}")
        t_end = time.time()
        if prom is not None:
            time.sleep(3)  # the last scrapes
            sys.path.insert(0, os.path.join(REPO, "deploy", "grafana"))
            from bench_render_dashboard import render

            print("dashboard:", render(prom.url, t_start - 5, t_end + 3, 1.0, 1.0,
                                       os.path.join(REPO, "deploy", "grafana", "dashboard.png"), rate_window="6s"))
            prom.stop()
            prom = None
        print(f"{' and '.join(args.protocols)} at infinite rate (no Prometheus) vs offline, {args.pairs} pairs:")
        # Offline runs between the served ones, each served run against the mean of its two neighbours, the
        # protocols' order alternating: the machine's speed drifts over minutes.
        offline_runs = [offline.run(fresh_tokens(wl, 100))]
        for k in range(args.pairs):
            pair = {}
            for protocol in args.protocols if k % 2 == 0 else args.protocols[::-1]:
                j = args.protocols.index(protocol)
                before = cpu_seconds(server.proc.pid)
                res = summarize(server.run(protocol, fresh_tokens(wl, 100 + k + 1000 * j), math.inf), math.inf)
                after = cpu_seconds(server.proc.pid)
                offline_runs.append(offline.run(fresh_tokens(wl, 100 + len(offline_runs))))
                pair[f"{protocol}_output_tok_s"], pair[f"{protocol}_failed"] = res["output_tok_s"], res["failed"]
                pair[f"{protocol}_offline_output_tok_s"] = statistics.mean(offline_runs[-2:])
                pair[f"{protocol}_cpu_s_per_1k_tokens"] = {
                    part: 1e3 * (after[part] - before.get(part, 0.0)) / wl.num_output_tokens for part in after}
            pairs.append(pair)
            print(f"  pair {k}: " + ", ".join(f"{p} {pair[f'{p}_output_tok_s']:.1f} (offline beside it "
                                             f"{pair[f'{p}_offline_output_tok_s']:.1f})" for p in args.protocols)
                  + " out tok/s; CPU s per 1k output tokens: "
                  + "; ".join(f"{p} {fmt_cpu(pair[f'{p}_cpu_s_per_1k_tokens'])}" for p in args.protocols))
    finally:
        if prom is not None:
            prom.stop()
        server.stop()
    actor = median_loss(direct, "actor_direct_output_tok_s")
    overhead = {"pairs": args.pairs, "vs_offline": pairs, "offline_runs": offline_runs,
                "actor_direct_vs_offline": direct, "ray_actor_loss": actor}
    for protocol in args.protocols:
        loss = median_loss(pairs, f"{protocol}_output_tok_s", f"{protocol}_offline_output_tok_s")
        overhead[f"{protocol}_throughput_loss"] = loss
        # what the gateway and the protocol add on top of the Ray-hosted engine
        overhead[f"{protocol}_gateway_loss"] = 1 - (1 - loss["median"]) / (1 - actor["median"])
        cpu = {part: statistics.median(p[f"{protocol}_cpu_s_per_1k_tokens"][part] for p in pairs)
               for part in pairs[0][f"{protocol}_cpu_s_per_1k_tokens"]}
        overhead[f"{protocol}_cpu_s_per_1k_tokens"] = cpu
        print(f"CPU seconds per 1k output tokens over {protocol} (median): {fmt_cpu(cpu)}")
        print(f"gateway overhead at infinite rate: {protocol} loses {loss['median']:.1%} of the offline engine's "
              f"output throughput (median of {args.pairs} pairs, {loss['min']:.1%} .. {loss['max']:.1%}); the "
              f"gateway and {protocol} add {overhead[f'{protocol}_gateway_loss']:.1%} to the Ray actor's "
              f"{actor['median']:.1%}")

    vllm = None
    if args.vllm:
        vllm = run_vllm(model_dir, wl, args.rates, args.max_num_seqs, args.out)

    base = statistics.mean(offline_runs + [p["offline_output_tok_s"] for p in direct])
    results = {"model": args.model, "device": args.device, "requests": len(wl.prompts),
               "prompt_tokens": wl.num_prompt_tokens, "output_tokens": wl.num_output_tokens,
               "offline": {"output_tok_s": base},
               "runs": {p: [dict(r, rate=str(r["rate"])) for r in rs] for p, rs in runs.items()},
               "gateway_overhead": overhead}
    if vllm is not None:
        results["vllm_serve"] = vllm
        if "http" in runs:
            results["pagedserve_http_vs_vllm_http"] = compare(runs["http"], vllm["runs"])
            print_comparison(runs["http"], vllm["runs"])
    print("saved", save_results(args.out, results))
    plot(results, args.out)


def run_vllm(model_dir: str, wl: Workload, rates: list[float], max_num_seqs: int, out: str) -> dict:
    log = os.path.join(tempfile.gettempdir(), f"{out}-vllm.log")
    server = VllmServer(model_dir, max_num_seqs, log)
    runs = []
    try:
        t = time.perf_counter()
        server.wait_ready()
        print(f"vllm serve ready in {time.perf_counter() - t:.0f} s (log: {log})")
        warm_up(server.run, wl)
        for i, rate in enumerate(rates):
            runs.append(summarize(server.run(fresh_tokens(wl, 1 + i), rate), rate))
            report(runs[-1], "vllm http")
    finally:
        server.stop()
    return {"vllm_version": vllm_version(), "runs": [dict(r, rate=str(r["rate"])) for r in runs]}


def vllm_version() -> str:
    """From the vLLM venv's package metadata (vLLM is not importable here)."""
    import glob

    found = glob.glob(os.path.join(VLLM_VENV, "lib", "python3*", "site-packages", "vllm*.dist-info"))
    return os.path.basename(found[0])[: -len(".dist-info")].split("-")[1] if found else "unknown"


def compare(ours: list[dict], theirs: list[dict]) -> list[dict]:
    """Per rate: pagedserve / vLLM for throughput (above 1: pagedserve faster) and for p50 latencies (below 1:
    pagedserve faster)."""
    rows = []
    for a, b in zip(ours, theirs):
        rows.append({"rate": str(a["rate"]), "output_tok_s": a["output_tok_s"] / b["output_tok_s"],
                     **{f"{k}_p50": a[k]["p50"] / b[k]["p50"] for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")}})
    return rows


def print_comparison(ours: list[dict], theirs: list[dict]) -> None:
    print("pagedserve HTTP vs vllm serve HTTP (ratios pagedserve / vLLM; throughput above 1 and latency below 1 "
          "favour pagedserve):")
    for row in compare(ours, theirs):
        print(f"  rate {row['rate']:>4}: out tok/s x{row['output_tok_s']:.2f}, TTFT p50 x{row['ttft_ms_p50']:.2f}, "
              f"TPOT p50 x{row['tpot_ms_p50']:.2f}, ITL p50 x{row['itl_ms_p50']:.2f}, E2E p50 x{row['e2e_ms_p50']:.2f}")


def plot(results: dict, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {f"pagedserve {p}": rs for p, rs in results["runs"].items()}
    if "vllm_serve" in results:
        series["vllm http"] = results["vllm_serve"]["runs"]
    first = next(iter(series.values()))
    labels = [r["rate"] for r in first]
    x = range(len(first))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in [(axes[0], "ttft_ms", "time to first token (p50, p99)"),
                           (axes[1], "tpot_ms", "time per output token (p50, p99)")]:
        for label, runs in series.items():
            line, = ax.plot(x, [r[key]["p50"] for r in runs], marker="o", label=f"{label} p50")
            ax.plot(x, [r[key]["p99"] for r in runs], marker="x", ls="--", color=line.get_color(),
                    label=f"{label} p99")
        ax.set_title(title)
        ax.set_ylabel("ms")
    width = 0.8 / len(series)
    for j, (label, runs) in enumerate(series.items()):
        axes[2].bar([i + (j - (len(series) - 1) / 2) * width for i in x], [r["output_tok_s"] for r in runs],
                    width, label=label)
    axes[2].axhline(results["offline"]["output_tok_s"], color="gray", ls="--", label="pagedserve offline")
    axes[2].set_title("output throughput")
    axes[2].set_ylabel("output tok/s")
    for ax in axes:
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("request rate (req/s)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{results['model']}, {results['requests']} sharegpt-like requests ({results['device']})")
    fig.tight_layout()
    fig.savefig(results_path(name, "png", results["device"]), dpi=110)


if __name__ == "__main__":
    main()
