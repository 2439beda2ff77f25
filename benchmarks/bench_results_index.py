"""benchmarks/results/INDEX.md from the results files: one row per result set outside archive/ (benchmark, machine,
date, commit, headline figure, files).

Usage: python benchmarks/bench_results_index.py [--out PATH]   (default: benchmarks/results/INDEX.md)
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MAX_FILES = 40  # outside archive/, this index included
# The first word of a machine slug (bench_common.cpu_slug / machine_slug); "cpu-unrecorded" predates the slugs.
BRANDS = ("epyc", "xeon", "ryzen", "core", "amd", "intel", "cpu", "nvidia")
MODELS = {"bench-llama-58m": "58m", "bench-qwen2-0.5b-shape": "0.5B", "bench-llama-1b-shape": "1B",
          "bench-llama-7b-shape": "7B", "bench-mixtral-tiny": "Mixtral-tiny"}


@dataclass
class Row:
    benchmark: str
    machine: str
    date: str
    commit: str
    headline: str
    files: list[str] = field(default_factory=list)


def split_name(stem: str) -> tuple[str, str]:
    """"serve_vs_vllm-kvfp8-epyc-zen5" -> ("serve_vs_vllm-kvfp8", "epyc-zen5")."""
    parts = stem.split("-")
    at = next((i for i, p in enumerate(parts) if i and p in BRANDS), len(parts))
    return "-".join(parts[:at]), "-".join(parts[at:])


def _x(v: float) -> str:
    return f"{v:.2f}x"


def _short(model: str) -> str:
    return MODELS.get(model, model)


def _serve_vs_vllm(d: dict) -> str:
    out = []
    for model, m in d["models"].items():
        cells = [f"{w} {_x(wd['targets']['throughput_ratio_at_inf'])}" for w, wd in m["workloads"].items()
                 if "throughput_ratio_at_inf" in wd.get("targets", {})]
        out.append(f"{_short(model)} " + ", ".join(cells))
    return "out tok/s / vLLM's at rate inf, median of pairs: " + "; ".join(out)


def _moe(d: dict) -> str:
    cells = [f"{key.removeprefix('bench-')} {_x(r['ratio'])}" for key, r in (d.get("runs") or {d['model']: d}).items()]
    return "out tok/s / vLLM's: " + ", ".join(cells)


def _vs_vllm(d: dict) -> str:
    by_workload: dict[str, list[dict]] = {}
    for r in d["rows"]:
        by_workload.setdefault(r["workload"], []).append(r)
    cells = []
    for w, rows in by_workload.items():
        ours = max(rows, key=lambda r: r["pagedserve_tok_s"])
        ratio = ours["pagedserve_tok_s"] / max(r["vllm_tok_s"] for r in rows)
        label = ours.get("pagedserve_quantization") or {"bfloat16": "bf16", "float32": "fp32"}.get(ours["dtype"])
        cell = f"{w} {label} {_x(ratio)}"
        runs = ours["all_runs"]
        if min(len(runs["pagedserve"]), len(runs["vllm"])) >= 3:
            cell += f" (medians {_x(statistics.median(runs['pagedserve']) / statistics.median(runs['vllm']))})"
        cells.append(cell)
    return f"{_short(d.get('model', ''))} out tok/s / vLLM's, best of each: " + ", ".join(cells)


def _throughput(d: dict) -> str:
    cells = []
    for w, wd in d["workloads"].items():
        p = wd["pagedserve"]
        if "vs_vllm" in p:
            cells.append(f"{w} {_x(p['vs_vllm'])} vLLM, {p['vs_hf_sequential']:.1f}x HF sequential")
        else:
            cells.append(f"{w} {p['output_tok_s']:.0f} out tok/s, {p['vs_hf_sequential']:.1f}x HF sequential, "
                         f"{p['vs_hf_static']:.1f}x HF static")
    return f"{_short(d.get('model', ''))} " + "; ".join(cells)


def _quant(d: dict) -> str:
    first = {}
    for r in d["results"]:
        first.setdefault(r["model"], r)
    return "int8 / bf16 decode tok/s: " + ", ".join(f"{_short(m)} {_x(r['speedup'])} at batch {r['batch']}"
                                                     for m, r in first.items())


def _kv_cache_fp8(d: dict) -> str:
    return f"{_short(d['model'])} fp8 / bf16 KV out tok/s: " + ", ".join(
        f"{_x(b['fp8']['output_tok_s'] / b['auto']['output_tok_s'])} at {b['kv_mib']} MiB" for b in d["budgets"])


def _cpu_gemm(d: dict) -> str:
    at: dict[tuple[str, str], float] = {}
    for r in d["rows"]:
        if r["rows"] == 128:
            at[r["model"], r["kernel"]] = r["gflop_s"]
    cells = []
    for model in dict.fromkeys(m for m, _ in at):
        ours = {k: v for (m, k), v in at.items() if m == model and k != "onednn" and not k.startswith("int8")}
        if ours and (model, "onednn") in at:
            kernel = max(ours, key=ours.get)
            cells.append(f"{_short(model)} {_x(ours[kernel] / at[model, 'onednn'])} ({kernel})")
    return "one layer's linears at 128 rows, ours / oneDNN GFLOP/s: " + ", ".join(cells)


def _kernels(d: dict) -> str:
    decode = max(r["frac_of_copy"] for r in d["decode"])
    prefill = max(d["prefill"], key=lambda r: r["tflops"])
    return (f"decode up to {decode:.0%} of the {d['copy_gbps'] / 1000:.2f} TB/s copy; prefill up to "
            f"{prefill['tflops']:.0f} TFLOP/s ({prefill['frac_of_matmul']:.0%} of the bf16 matmul)")


def _speculative(d: dict) -> str:
    ones = [r for r in d["rows"] if r["concurrency"] == 1]
    return "n-gram drafts, per-token latency at concurrency 1: " + ", ".join(
        f"{r['workload']} {_x(r['latency_ratio'])}" for r in ones)


def _sharing(d: dict) -> str:
    best = max(d["sharing"], key=lambda k: d["sharing"][k]["throughput_gain"])
    return (f"prefix caching {_x(d['prefix_caching']['throughput_gain'])} out tok/s; block sharing up to "
            f"{_x(d['sharing'][best]['throughput_gain'])} ({best})")


def _serve(d: dict) -> str:
    inf = next(r for r in d["pagedserve_http_vs_vllm_http"] if r["rate"] == "inf")
    return f"HTTP out tok/s / vLLM's at rate inf: {_x(inf['output_tok_s'])}"


def _fairness(d: dict) -> str:
    reps = d["replicas"]
    ns = list(reps)

    def cells(get, fmt) -> str:
        return " / ".join(fmt(get(reps[n])) for n in ns)  # no "|": the cell is in a table

    met = sum(t["met"] for t in d["targets"])
    return (f"fairness over fcfs, {' / '.join(ns)} replicas: B TTFT p95 "
            f"{cells(lambda r: r['flood']['ratios']['b_ttft_p95'], _x)}, out tok/s "
            f"{cells(lambda r: r['flood']['ratios']['output_tok_s'], _x)}; Jain "
            f"{cells(lambda r: r['backlog']['equal']['tokens']['jain_mean'], '{:.2f}'.format)}; weights 2:1 -> "
            f"{cells(lambda r: r['backlog']['weighted']['tokens']['ratio_overall'], '{:.2f}'.format)}; priority-0 at "
            f"a full cache {cells(lambda r: r['priority']['extra_steps'], '+{:.1f}'.format)} steps; "
            f"{met}/{len(d['targets'])} targets met")


HEADLINES = {
    "serve_vs_vllm": _serve_vs_vllm,
    "vs_vllm": _vs_vllm,
    "throughput": _throughput,
    "quant": _quant,
    "kv_cache_fp8": _kv_cache_fp8,
    "cpu_gemm": _cpu_gemm,
    "kernels": _kernels,
    "speculative": _speculative,
    "sharing": _sharing,
    "serve": _serve,
    "fairness": _fairness,
    "moe": _moe,
    "cluster": lambda d: (f"prefix-aware / least-loaded: {_x(d['summary']['throughput_vs_least_loaded'])} out tok/s, "
                          f"TTFT p50 {_x(d['summary']['ttft_p50_vs_least_loaded'])}"),
    "disagg": lambda d: (f"1P+1D / aggregated: ITL p99 {_x(d['summary']['itl_p99_vs_aggregated'])} at "
                         f"{_x(d['summary']['throughput_vs_aggregated'])} out tok/s"
                         + (f" (vLLM's client: {_x(d['summary']['vllm_client_itl_p99_vs_aggregated'])} at "
                            f"{_x(d['summary']['vllm_client_stream_tok_s_vs_aggregated'])})"
                            if "vllm_client_itl_p99_vs_aggregated" in d["summary"] else "")),
    "tp": lambda d: ("TP=2 / TP=1 out tok/s: "
                     f"{_x(d['throughput']['tp2_plain_calls_out_tok_s'] / d['throughput']['tp1_out_tok_s'])}"),
}


def json_row(path: Path, files: list[str]) -> Row:
    d = json.loads(path.read_text())
    benchmark, machine = split_name(path.stem)
    make = HEADLINES.get(benchmark.split("-")[0])
    return Row(benchmark, machine, str(d.get("date", ""))[:10],
               d.get("commit") or f"torch {d.get('torch', '?')}", make(d) if make else "", files)


def log_row(path: Path, files: list[str]) -> Row:
    """A GPU check's log: its pytest summaries are the headline; the date is in its name."""
    stem = path.stem
    date = re.search(r"-(\d{4}-\d{2}-\d{2})$", stem)
    benchmark, machine = split_name(stem[:date.start()] if date else stem)
    passed = re.findall(r"^(\d+ passed.*?) in [\d.]+s", path.read_text(), re.M)
    return Row(benchmark, machine, date.group(1) if date else "", "—", "tests: " + "; ".join(passed), files)


def collect(results: Path = RESULTS) -> list[Row]:
    """One row per JSON outside archive/ (its plot, same name, beside it); any other file a row of its own."""
    paths = sorted(p for p in results.rglob("*") if p.is_file() and "archive" not in p.relative_to(results).parts
                   and p.name != "INDEX.md")
    stems = {p.with_suffix("") for p in paths if p.suffix == ".json"}
    rows = []
    for p in paths:
        if p.suffix != ".json" and p.with_suffix("") in stems:
            continue
        files = [str(q.relative_to(results)) for q in paths if q.with_suffix("") == p.with_suffix("")]
        rows.append(json_row(p, files) if p.suffix == ".json" else log_row(p, files))
    return sorted(rows, key=lambda r: (r.benchmark, r.machine))


def render(rows: list[Row]) -> str:
    lines = [
        "# Results index",
        "",
        "Made by `python benchmarks/bench_results_index.py` from the files beside it; do not edit. One row per",
        "current result set: the latest run of each benchmark (and configuration) per machine class. Earlier runs",
        "are in `archive/` under the names they had then. Ratios are pagedserve's over the baseline named, measured",
        "side by side in one run; [docs/performance.md](../../docs/performance.md) says how.",
        "",
        "| benchmark | machine | date | commit (else what it records) | headline | files |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        files = ", ".join(f"[{Path(f).suffix[1:]}]({f})" for f in r.files)
        lines.append(f"| {r.benchmark} | {r.machine} | {r.date} | {r.commit} | {r.headline} | {files} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS / "INDEX.md")
    args = ap.parse_args(argv)
    args.out.write_text(render(collect()))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
