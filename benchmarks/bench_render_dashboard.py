"""Render the Grafana dashboard's key panels from Prometheus data into a PNG (no Grafana needed).

Each panel's queries, exactly as in pagedserve-dashboard.json, are run over the HTTP API (``query_range``) with the
Grafana variables filled in, and drawn with matplotlib: time series as lines (stacked where the panel stacks),
heatmaps as heatmaps. Run it at the end of a load run:

    python benchmarks/bench_render_dashboard.py --prometheus http://localhost:9090 --minutes 15
    python benchmarks/bench_render_dashboard.py --prometheus http://127.0.0.1:9091 --start 1732240000 --end 1732240300 \
        --step 2 --scrape-interval 1 --out /tmp/dashboard.png
"""
from __future__ import annotations

import argparse
import math
import os
import re
import time

from pagedserve.tests import promql

DEFAULT_OUT = os.path.join(promql.DEPLOY_DIR, "grafana", "dashboard.png")
KEY_PANELS = [
    "Time to first token", "Inter-token latency", "End-to-end request latency", "Queue time",
    "Token throughput", "Finish reasons", "Scheduler state", "KV cache usage",
    "Prefix cache hit rate", "Preemptions and swaps", "Step time by phase (mean)", "Errors by code",
    "Prompt length", "Generation length",
]
UNITS = {"s": ("seconds", 1.0), "percentunit": ("%", 100.0), "reqps": ("requests/s", 1.0), "short": ("", 1.0)}


def rate_interval(step: float, scrape_interval: float) -> str:
    """Grafana's $__rate_interval: max(step + scrape interval, 4 x scrape interval)."""
    return f"{math.ceil(max(step + scrape_interval, 4 * scrape_interval))}s"


def legend(fmt: str, labels: dict) -> str:
    if not fmt:
        return ",".join(f"{k}={v}" for k, v in labels.items() if k != "__name__") or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def fetch(url: str, panel: dict, start: float, end: float, step: float, variables: dict) -> list[tuple]:
    """[(legend, times, values)] over all the panel's targets."""
    out = []
    for t in panel.get("targets", []):
        expr = promql.substitute(t["expr"], **variables)
        for series in promql.query_range(url, expr, start, end, step):
            ts = [float(x) for x, _ in series["values"]]
            vs = [float(v) for _, v in series["values"]]
            out.append((legend(t.get("legendFormat", ""), series["metric"]), ts, vs))
    return out


def _le(x: str) -> float:
    return math.inf if x in ("+Inf", "Inf") else float(x)


def draw_timeseries(ax, panel: dict, data: list[tuple], t0: float) -> None:
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
    label, scale = UNITS.get(unit, (unit, 1.0))
    stacked = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {}).get("stacking", {}).get("mode") \
        == "normal"
    if stacked and data:
        import numpy as np

        times = sorted({t for _, ts, _ in data for t in ts})
        idx = {t: i for i, t in enumerate(times)}
        ys = []
        for _, ts, vs in data:
            y = np.zeros(len(times))
            for t, v in zip(ts, vs):
                y[idx[t]] = 0.0 if math.isnan(v) else v * scale
            ys.append(y)
        ax.stackplot([t - t0 for t in times], ys, labels=[n for n, _, _ in data], alpha=0.7)
    else:
        for name, ts, vs in data:
            ax.plot([t - t0 for t in ts], [v * scale for v in vs], label=name, linewidth=1.2)
    ax.set_ylabel(label)
    if unit == "percentunit":
        ax.set_ylim(0, 105)
    if data:
        ax.legend(fontsize=6.5, loc="upper left", ncol=2 if len(data) > 4 else 1, framealpha=0.6)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")


def draw_heatmap(ax, data: list[tuple], t0: float) -> None:
    import numpy as np

    if not data:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        return
    data = sorted(data, key=lambda d: _le(d[0]))
    times = sorted({t for _, ts, _ in data for t in ts})
    idx = {t: i for i, t in enumerate(times)}
    cum = np.zeros((len(data), len(times)))
    for r, (_, ts, vs) in enumerate(data):
        for t, v in zip(ts, vs):
            cum[r, idx[t]] = 0.0 if math.isnan(v) else v
    counts = np.diff(np.vstack([np.zeros((1, len(times))), cum]), axis=0).clip(min=0)  # cumulative -> per bucket
    keep = np.flatnonzero(counts.sum(axis=1) > 0)
    lo, hi = (keep[0], keep[-1] + 1) if len(keep) else (0, len(data))
    counts = counts[lo:hi]
    names = [d[0] for d in data[lo:hi]]
    x = [t - t0 for t in times]
    x_edges = np.concatenate([x, [x[-1] + (x[-1] - x[-2] if len(x) > 1 else 1)]])
    mesh = ax.pcolormesh(x_edges, np.arange(len(names) + 1), np.ma.masked_equal(counts, 0), cmap="Oranges",
                         shading="flat")
    ax.set_yticks(np.arange(len(names)) + 0.5)
    ax.set_yticklabels([f"<= {_le(n):g}" for n in names], fontsize=6.5)
    ax.set_ylabel("tokens")
    ax.figure.colorbar(mesh, ax=ax, pad=0.01).set_label("requests", fontsize=7)


def render(url: str, start: float, end: float, step: float, scrape_interval: float, out: str,
           model_name: str = ".*", panels: list[str] | None = None, dashboard_path: str = promql.DASHBOARD_PATH,
           columns: int = 2, rate_window: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = promql.load_dashboard(dashboard_path)
    by_title = {p["title"]: p for p in promql.iter_panels(dashboard)}
    titles = panels or [t for t in KEY_PANELS if t in by_title]
    missing = [t for t in titles if t not in by_title]
    if missing:
        raise SystemExit(f"no such panel(s) in {dashboard_path}: {missing}")
    variables = dict(model_name=model_name, rate_interval=rate_window or rate_interval(step, scrape_interval),
                     interval=f"{step:g}s", range_=f"{int(end - start)}s")
    rows = math.ceil(len(titles) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(8 * columns, 3.1 * rows), squeeze=False)
    for ax, title in zip(axes.flat, titles):
        panel = by_title[title]
        data = fetch(url, panel, start, end, step, variables)
        if panel["type"] == "heatmap":
            draw_heatmap(ax, data, start)
        else:
            draw_timeseries(ax, panel, data, start)
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        ax.set_xlim(0, end - start)
        ax.set_xlabel("seconds", fontsize=7)
    for ax in list(axes.flat)[len(titles):]:
        ax.axis("off")
    fig.suptitle(f"{dashboard['title']}: model_name=~\"{model_name}\", "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(start))} + {end - start:.0f} s "
                 f"(step {step:g} s, rate window {variables['rate_interval']})", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prometheus", default="http://localhost:9090", help="Prometheus base URL")
    ap.add_argument("--minutes", type=float, default=15.0, help="time range ending now (without --start)")
    ap.add_argument("--start", type=float, help="range start, unix seconds")
    ap.add_argument("--end", type=float, help="range end, unix seconds (default: now)")
    ap.add_argument("--step", type=float, help="query resolution in seconds (default: range / 240, at least 1)")
    ap.add_argument("--scrape-interval", type=float, default=10.0,
                    help="the pagedserve job's scrape interval in seconds, for $__rate_interval (default 10)")
    ap.add_argument("--rate-interval", help="override $__rate_interval (a PromQL duration, e.g. 30s)")
    ap.add_argument("--model-name", default=".*", help="value of the $model_name variable (a regex; .* = All)")
    ap.add_argument("--panel", action="append", dest="panels", help="panel title to draw (repeatable; "
                    "default: the key panels)")
    ap.add_argument("--all", action="store_true", help="draw every time series and heatmap panel")
    ap.add_argument("--dashboard", default=promql.DASHBOARD_PATH)
    ap.add_argument("--out", default=DEFAULT_OUT)
    a = ap.parse_args(argv)
    end = a.end or time.time()
    start = a.start or end - 60 * a.minutes
    step = a.step or max(1.0, round((end - start) / 240))
    panels = a.panels
    if a.all:
        panels = [p["title"] for p in promql.iter_panels(promql.load_dashboard(a.dashboard))
                  if p["type"] in ("timeseries", "heatmap")]
    print(render(a.prometheus.rstrip("/"), start, end, step, a.scrape_interval, a.out, a.model_name, panels,
                 a.dashboard, rate_window=a.rate_interval))


if __name__ == "__main__":
    main()
