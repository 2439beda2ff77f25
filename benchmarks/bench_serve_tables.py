"""Markdown tables of a `bench_serve_vs_vllm.py` results file: per rate, each system's figures and every pair's ratios.

Usage: python benchmarks/bench_serve_tables.py benchmarks/results/serve_vs_vllm-epyc-zen5.json [--model bench-llama-58m]
"""
from __future__ import annotations

import argparse
import json

SYSTEMS = ("pagedserve", "vllm")
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms")


def _ms(m: dict, key: str) -> str:
    fmt = "{:.0f}" if key == "ttft_ms" else "{:.1f}"
    return f"{fmt.format(m[key]['p50'])} / {fmt.format(m[key]['p99'])}"


def _pairs_cell(pairs: list[dict], key: str, median: float, within: str = "") -> str:
    ratios = ", ".join(f"{p['ratios'][key]:.2f}x" for p in pairs)
    tail = within or ("pagedserve " + "/".join(f"{p['pagedserve']['output_tok_s']:.0f}" for p in pairs) + ", vLLM "
                      + "/".join(f"{p['vllm']['output_tok_s']:.0f}" for p in pairs))
    return f"{ratios} (median **{median:.2f}x**; {tail})"


def rate_rows(run: dict) -> list[str]:
    rate, r = run["rate"], run["ratios"]
    rows = []
    for s in SYSTEMS:
        m = run[s]
        rows.append(f"| {rate} | {s} | {m['output_tok_s']:.1f} | " + " | ".join(_ms(m, k) for k in LATENCIES)
                    + f" | {m['failed']} | {m['goodput_req_s']:.2f} ({m['slo_met']}/{m['completed'] + m['failed']}) |")
    rows.append(f"| {rate} | **ratio** | **{r['output_tok_s']:.2f}x** | {r['ttft_p50']:.2f}x | {r['tpot_p50']:.2f}x | "
                f"{r['itl_p50']:.2f}x | | {r['goodput']:.2f}x |")
    if "pairs" in run:
        pairs, med = run["pairs"], run["median"]
        failed = "+".join(f"{p['pagedserve']['failed']}/{p['vllm']['failed']}" for p in pairs)
        within = "vLLM within the SLO: " + "/".join(str(p["vllm"]["slo_met"]) for p in pairs)
        rows.append(f"| {rate} | {len(pairs)} pairs | {_pairs_cell(pairs, 'output_tok_s', med['output_tok_s'])} "
                    f"| | | | {failed} | {_pairs_cell(pairs, 'goodput', med['goodput'], within)} |")
    return rows


def workload_table(model: str, name: str, w: dict) -> str:
    slo, loads = w["slo"], w["loadavg_1min_before_runs"]
    interval = f"--stream-interval {w['stream_interval']} on both; " if w.get("stream_interval", 1) != 1 else ""
    head = (f"{model}, {name} ({w['requests']} requests; SLO TTFT <= {slo['ttft_ms'] / 1000:.1f} s, TPOT <= "
            f"{slo['tpot_ms']:.0f} ms; load {loads['min']:.1f}-{loads['max']:.1f}; engine niceness "
            f"{w['pagedserve_engine_niceness']}; {interval}{w['date']}):")
    lines = [head, ""]
    if any("pairs" in run for run in w["runs"]):
        lines += ["(with several pairs a rate, its rows are the pair with the median throughput ratio)"]
    lines += ["| rate | system | out tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | failed "
              "| goodput req/s (SLO met) |", "|---|---|---|---|---|---|---|---|"]
    for run in w["runs"]:
        lines += rate_rows(run)
    t = w["targets"]
    goodput = (f"goodput at rate {t['goodput_rate']} x{t['goodput_ratio']:.2f}" if t["goodput_rate"] is not None
               else "goodput n/a (vLLM met the SLO for under half its requests at every rate run)")
    at_inf = (f"out tok/s at rate inf x{t['throughput_ratio_at_inf']:.2f}" if "throughput_ratio_at_inf" in t
              else "out tok/s at rate inf not run")
    lines += ["", f"Targets: {at_inf}, {goodput}: {'met' if t['met'] else 'not met'}."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--model", default=None, help="one model (default: every model in the file)")
    args = ap.parse_args()
    with open(args.results) as f:
        models = json.load(f)["models"]
    for model, m in models.items():
        if args.model in (None, model):
            for name, w in m["workloads"].items():
                print(workload_table(model, name, w) + "\n\n")


if __name__ == "__main__":
    main()
