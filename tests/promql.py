"""The PromQL in deploy/: the Grafana dashboard's panel queries and the alert rules' expressions, with the small
amount of PromQL parsing the tests and ``render_dashboard.py`` need (Grafana variable substitution, splitting an
alert into its threshold-free signals, the metric and label names an expression uses)."""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

DEPLOY_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy")
DASHBOARD_PATH = os.path.join(DEPLOY_DIR, "grafana", "pagedserve-dashboard.json")
PROMETHEUS_CONFIG_PATH = os.path.join(DEPLOY_DIR, "prometheus", "prometheus.yml")
ALERTS_PATH = os.path.join(DEPLOY_DIR, "prometheus", "alerts.yml")
ALERTS_TEST_PATH = os.path.join(DEPLOY_DIR, "prometheus", "alerts_test.yml")

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
            "offset", "inf", "nan", "atan2"}
_COMPARISON = ("==", "!=", ">=", "<=", ">", "<")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


@dataclass
class PanelQuery:
    panel: str  # panel title
    ref_id: str
    expr: str  # as written in the dashboard, with Grafana variables


def load_dashboard(path: str = DASHBOARD_PATH) -> dict:
    with open(path) as f:
        return json.load(f)


def iter_panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, rows' nested panels included (rows themselves excluded)."""
    for p in dashboard.get("panels", []):
        if p.get("type") == "row":
            yield from p.get("panels", [])
        else:
            yield p


def dashboard_queries(dashboard: dict | None = None) -> list[PanelQuery]:
    dashboard = dashboard or load_dashboard()
    return [PanelQuery(p.get("title", ""), t.get("refId", ""), t["expr"])
            for p in iter_panels(dashboard) for t in p.get("targets", []) if t.get("expr")]


def variable_queries(dashboard: dict | None = None) -> dict[str, str]:
    """The query of each ``query``-type template variable."""
    dashboard = dashboard or load_dashboard()
    out = {}
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            out[v["name"]] = q.get("query", "") if isinstance(q, dict) else q
    return out


def substitute(expr: str, model_name: str = ".*", rate_interval: str = "1m", interval: str = "15s",
               range_: str = "1h") -> str:
    """Replace the Grafana variables of a panel query; raise on any variable left over."""
    values = {"model_name": model_name, "__rate_interval": rate_interval, "__interval": interval, "__range": range_}

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise ValueError(f"unknown Grafana variable ${name} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, expr)


def load_alert_rules(path: str = ALERTS_PATH) -> list[dict]:
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f)
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


# ---- a little PromQL scanning ---------------------------------------------------------------------------------
def _depths(expr: str) -> list[int]:
    """Nesting depth ((), [], {}) at each character; characters inside string literals get depth -1."""
    out, depth, quote, i = [], 0, None, 0
    while i < len(expr):
        c = expr[i]
        if quote:
            out.append(-1)
            if c == "\\" and quote != "`":
                out.append(-1)
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'`":
            quote = c
            out.append(-1)
        elif c in "([{":
            out.append(depth)
            depth += 1
        elif c in ")]}":
            depth -= 1
            out.append(depth)
        else:
            out.append(depth)
        i += 1
    return out


def _strip_parens(expr: str) -> str:
    expr = expr.strip()
    while expr.startswith("(") and expr.endswith(")"):
        d = _depths(expr)
        if any(x == 0 for x in d[1:-1]):  # "(a) + (b)": the outer parens are not one group
            break
        expr = expr[1:-1].strip()
    return expr


_SET_OP = re.compile(r"\b(and|or|unless)\b(\s*(on|ignoring)\s*\([^)]*\))?(\s*(group_left|group_right)\s*(\([^)]*\))?)?")


def split_set_operands(expr: str) -> list[str]:
    """The operands of the top-level ``and``/``or``/``unless`` of an expression (itself if there is none)."""
    d = _depths(expr)
    parts, start = [], 0
    for m in _SET_OP.finditer(expr):
        if d[m.start()] == 0:
            parts.append(expr[start:m.start()])
            start = m.end()
    parts.append(expr[start:])
    return [_strip_parens(p) for p in parts]


def strip_threshold(expr: str) -> str:
    """``<signal> <comparison> [bool] <number>`` -> ``<signal>``: the expression without its threshold."""
    expr = _strip_parens(expr)
    d = _depths(expr)
    for i in range(len(expr) - 1, -1, -1):
        if d[i] != 0:
            continue
        for op in _COMPARISON:
            if expr.startswith(op, i) and not (op in (">", "<") and expr.startswith("=", i + 1)) \
                    and not (i > 0 and expr[i - 1] in "<>=!"):
                rhs = expr[i + len(op):].strip()
                rhs = re.sub(r"^bool\s+", "", rhs)
                if _NUMBER.fullmatch(rhs):
                    return _strip_parens(expr[:i])
                return expr
    return expr


def alert_signals(expr: str) -> list[str]:
    """The threshold-free signals an alert compares: each set-operator operand without its threshold."""
    return [strip_threshold(p) for p in split_set_operands(expr)]


_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(=~|!~|!=|=)")
_IDENT = re.compile(r"(?<![\w.$:])([a-zA-Z_:][\w:]*)")


def _blank_strings(expr: str) -> str:
    d = _depths(expr)
    return "".join('"' if x == -1 else c for c, x in zip(expr, d))


def label_names(expr: str) -> set[str]:
    """Label names an expression matches on or aggregates by."""
    e = _blank_strings(expr)
    names = set()
    for m in _LABEL_LIST.finditer(e):
        names |= {x.strip() for x in m.group(2).split(",") if x.strip()}
    for body in re.findall(r"\{([^}]*)\}", e):
        names |= {m.group(1) for m in _MATCHER.finditer(body)}
    return names


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (function names, keywords, labels and durations excluded)."""
    e = _blank_strings(expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = _LABEL_LIST.sub(" ", e)
    e = e.replace('"', " ")
    names = set()
    for m in _IDENT.finditer(e):
        name = m.group(1)
        rest = e[m.end():].lstrip()
        if name in KEYWORDS or rest.startswith("("):
            continue
        names.add(name)
    return names


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, its ``{...}`` matcher text or "") for every metric selector of an expression."""
    e = _blank_strings(expr)
    out = []
    for name in metric_names(expr):
        for m in re.finditer(rf"(?<![\w:]){re.escape(name)}(?![\w:(])\s*(\{{[^}}]*\}})?", e):
            out.append((name, expr[m.start(1):m.end(1)] if m.group(1) else ""))
    return out


# ---- Prometheus over HTTP, and a throwaway local Prometheus ----------------------------------------------------
def _get(url: str, params: dict, timeout: float = 10.0) -> dict:
    import urllib.parse
    import urllib.request

    with urllib.request.urlopen(f"{url}?{urllib.parse.urlencode(params)}", timeout=timeout) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{url} {params}: {body}")
    return body["data"]


def query(base_url: str, expr: str, at: float | None = None) -> list[dict]:
    """Instant query: the result vector (or [] ) of ``/api/v1/query``."""
    params = {"query": expr}
    if at is not None:
        params["time"] = f"{at:.3f}"
    data = _get(base_url + "/api/v1/query", params)
    return data["result"] if data["resultType"] in ("vector", "matrix") else [{"metric": {}, "value": data["result"]}]


def query_range(base_url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    return _get(base_url + "/api/v1/query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                                   "step": f"{step:g}"})["result"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalPrometheus:
    """A ``prometheus`` process on loopback scraping the given gateway ``/metrics`` targets, configured from
    deploy/prometheus/prometheus.yml (interval shortened, the alert rules loaded), storing under ``workdir``."""

    def __init__(self, targets: list[str], workdir: str, scrape_interval: str = "1s", binary: str = "prometheus"):
        self.targets, self.workdir, self.scrape_interval, self.binary = targets, workdir, scrape_interval, binary
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.log_path = os.path.join(workdir, "prometheus.log")

    def config(self) -> dict:
        import yaml

        with open(PROMETHEUS_CONFIG_PATH) as f:
            cfg = yaml.safe_load(f)
        cfg["global"].update(scrape_interval=self.scrape_interval, evaluation_interval=self.scrape_interval)
        base = os.path.dirname(PROMETHEUS_CONFIG_PATH)
        cfg["rule_files"] = [os.path.join(base, p) for p in cfg.get("rule_files", [])]
        cfg.pop("alerting", None)
        (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "pagedserve"]
        job.update(scrape_interval=self.scrape_interval, scrape_timeout=self.scrape_interval,
                   static_configs=[{"targets": list(self.targets)}])
        return cfg

    def start(self, timeout: float = 30.0) -> LocalPrometheus:
        import subprocess
        import time
        import urllib.request

        import yaml

        os.makedirs(self.workdir, exist_ok=True)
        cfg_path = os.path.join(self.workdir, "prometheus.yml")
        with open(cfg_path, "w") as f:
            yaml.safe_dump(self.config(), f)
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={cfg_path}", f"--storage.tsdb.path={os.path.join(self.workdir, 'data')}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"prometheus not ready after {timeout} s: {self.log()}")

    def log(self) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        import subprocess

        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        return query(self.url, expr, at)

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        return query_range(self.url, expr, start, end, step)

    def __enter__(self) -> LocalPrometheus:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
