"""deploy/: the Prometheus config and alert rules pass promtool (and their unit tests), the Grafana dashboard and
provisioning files are well formed, and every metric name a panel or an alert uses is one the code exports."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import yaml

from pagedserve.tests import promql

GRAFANA_DIR = os.path.join(promql.DEPLOY_DIR, "grafana")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="the `promtool` binary is missing: run deploy/install_prometheus.sh (Debian package prometheus)")
PROMETHEUS_BUILTINS = {"up", "scrape_duration_seconds", "scrape_samples_scraped",
                       "scrape_samples_post_metric_relabeling", "scrape_series_added"}


def _promtool(*args: str) -> str:
    proc = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"promtool {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


@needs_promtool
def test_promtool_check_config():
    out = _promtool("check", "config", promql.PROMETHEUS_CONFIG_PATH)
    assert "SUCCESS" in out and "1 rule files found" in out


@needs_promtool
def test_promtool_check_rules():
    out = _promtool("check", "rules", promql.ALERTS_PATH)
    assert f"{len(promql.load_alert_rules())} rules found" in out


@needs_promtool
def test_promtool_test_rules():
    _promtool("test", "rules", promql.ALERTS_TEST_PATH)


def test_alert_unit_tests_cover_every_alert():
    """Each alert has a promtool case where it fires and one where it must not."""
    with open(promql.ALERTS_TEST_PATH) as f:
        doc = yaml.safe_load(f)
    fires, silent = set(), set()
    for t in doc["tests"]:
        for case in t.get("alert_rule_test", []):
            (fires if case.get("exp_alerts") else silent).add(case["alertname"])
    alerts = {r["alert"] for r in promql.load_alert_rules()}
    assert alerts - fires == set(), "alerts never tested firing"
    assert alerts - silent == set(), "alerts never tested silent"
    for r in promql.load_alert_rules():
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"], r["alert"]


def test_prometheus_config_scrapes_the_gateway():
    with open(promql.PROMETHEUS_CONFIG_PATH) as f:
        cfg = yaml.safe_load(f)
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "pagedserve"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"][0]["targets"] == ["localhost:9400"]
    assert cfg["rule_files"] == ["alerts.yml"]
    from pagedserve.cluster.entrypoints.serve_options import ServeOptions

    assert ServeOptions().metrics_port == 9400  # the documented default target port


# ---- the dashboard ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dashboard() -> dict:
    with open(promql.DASHBOARD_PATH) as f:
        return json.load(f)  # valid JSON


def test_dashboard_is_provisionable(dashboard):
    assert dashboard["uid"] == "pagedserve" and dashboard["title"] and dashboard["schemaVersion"] >= 36
    assert "__inputs" not in dashboard and dashboard.get("id") is None  # file provisioning, not UI import
    panels = list(promql.iter_panels(dashboard))
    ids = [p["id"] for p in dashboard["panels"]] + [p["id"] for p in panels if p not in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for p in panels:
        assert p["title"] and p["type"] in ("timeseries", "stat", "table", "heatmap", "bargauge", "gauge"), p
        assert set(p["gridPos"]) == {"x", "y", "w", "h"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip(), (p["title"], t)
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]


def test_dashboard_variables(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    model = variables["model_name"]
    assert model["type"] == "query" and model["datasource"]["uid"] == "${datasource}"
    assert model["multi"] and model["includeAll"] and model["allValue"] == ".*"
    q = promql.variable_queries(dashboard)["model_name"]
    assert q.replace(" ", "").startswith("label_values(") and q.replace(" ", "").endswith(",model_name)"), q


def test_dashboard_covers_the_required_panels(dashboard):
    titles = {p["title"] for p in promql.iter_panels(dashboard)}
    for t in ["Time to first token", "Inter-token latency", "End-to-end request latency", "Queue time",
              "Token throughput", "Scheduler state", "KV cache usage", "Prefix cache hit rate",
              "Preemptions and swaps", "Finish reasons", "Prompt length", "Generation length",
              "Step time by phase (mean)", "Errors by code"]:
        assert t in titles, t
    exprs = {q.panel: q.expr for q in promql.dashboard_queries(dashboard)}
    for t in ["Time to first token", "Inter-token latency", "End-to-end request latency", "Queue time"]:
        qs = [q.expr for q in promql.dashboard_queries(dashboard) if q.panel == t]
        assert [e.split(",")[0] for e in qs] == [f"histogram_quantile({x}" for x in ("0.5", "0.9", "0.99")], t
    assert "by (model_name, phase)" in exprs["Step time by phase (mean)"]
    heatmaps = [p for p in promql.iter_panels(dashboard) if p["type"] == "heatmap"]
    assert len(heatmaps) == 2 and all(p["targets"][0]["format"] == "heatmap" for p in heatmaps)


def test_every_panel_filters_by_model(dashboard):
    """Each pagedserve selector of each panel honours the $model_name variable."""
    bad = []
    for q in promql.dashboard_queries(dashboard):
        promql.substitute(q.expr)  # only known Grafana variables
        for name, matchers in promql.selectors(q.expr):
            if name.startswith("pagedserve_") and 'model_name=~"$model_name"' not in matchers:
                bad.append((q.panel, name))
    assert not bad, bad


# ---- metric names -------------------------------------------------------------------------------------------
def _family_series(fam) -> set[str]:
    names = {s.name for s in fam.samples}
    kind = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""], "info": ["_info"],
            "summary": ["_sum", "_count", ""], "unknown": [""]}[fam.type]
    return names | {fam.name + k for k in kind}


@pytest.fixture(scope="module")
def exported_names(llama_dir) -> set[str]:
    """The series names /metrics serves, derived from the code: the gateway registry (labelled metrics included
    before their first observation), the workers gauges, and a real engine core's scheduler metrics."""
    from pagedserve.cluster.runtime.core_metrics import EngineCoreMetrics
    from pagedserve.cluster.runtime.replicas import Replica
    from pagedserve.cluster.runtime.router import ReplicaRouter
    from pagedserve.cluster.server.metrics import GatewayMetrics
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=llama_dir))
    try:
        gm = GatewayMetrics("m")
        router = ReplicaRouter([Replica(0, None, None)], None, [engine.core.get_info()])
        router.replicas[0].alive = False  # a dead replica: no Ray call, workers gauges only
        gm.engines.engine = router
        gm.engines.refresh()  # the snapshot a scrape reads
        fams = list(gm.registry.collect())
        fams += EngineCoreMetrics(engine.core).collect()
    finally:
        engine.core.shutdown()
    names = set().union(*(_family_series(f) for f in fams))
    assert {"pagedserve_workers_up", "pagedserve_requests_finished_total", "pagedserve_request_errors_total",
            "pagedserve_step_duration_seconds_bucket", "pagedserve_num_requests_running"} <= names
    return names


def _unknown(exprs: list[tuple[str, str]], known: set[str]) -> list[tuple[str, str]]:
    return [(where, name) for where, e in exprs for name in sorted(promql.metric_names(e)) if name not in known]


def _all_exprs(dashboard) -> list[tuple[str, str]]:
    out = [(f"panel {q.panel}/{q.ref_id}", q.expr) for q in promql.dashboard_queries(dashboard)]
    out += [(f"variable {n}", q[q.index("(") + 1:q.index(",")]) for n, q in promql.variable_queries(dashboard).items()]
    out += [(f"alert {r['alert']}", r["expr"]) for r in promql.load_alert_rules()]
    return out


def test_every_metric_name_is_exported(dashboard, exported_names):
    exprs = _all_exprs(dashboard)
    assert sum(len(promql.metric_names(e)) for _, e in exprs) > 50
    assert not _unknown(exprs, exported_names | PROMETHEUS_BUILTINS)


def test_a_typo_would_be_caught(exported_names):
    known = exported_names | PROMETHEUS_BUILTINS
    typos = [("t1", 'sum by (model_name) (rate(pagedserve_generation_token_total{model_name=~"$model_name"}[5m]))'),
             ("t2", "histogram_quantile(0.9, sum by (le) (rate(pagedserve_time_to_first_token_bucket[5m])))"),
             ("t3", "pagedserve_num_requests_running > 0 unless on (model_name) pagedserve_kv_cache_usage > 0")]
    assert _unknown(typos, known) == [("t1", "pagedserve_generation_token_total"),
                                      ("t2", "pagedserve_time_to_first_token_bucket"),
                                      ("t3", "pagedserve_kv_cache_usage")]


def test_promql_helpers():
    e = ('sum by (model_name) (pagedserve_num_requests_running{job="x"}) > 0\n'
         'unless on (model_name)\nsum by (model_name) (rate(pagedserve_generation_tokens_total[5m])) > bool 0.5')
    assert promql.alert_signals(e) == ['sum by (model_name) (pagedserve_num_requests_running{job="x"})',
                                       "sum by (model_name) (rate(pagedserve_generation_tokens_total[5m]))"]
    assert promql.metric_names(e) == {"pagedserve_num_requests_running", "pagedserve_generation_tokens_total"}
    assert promql.label_names(e) == {"model_name", "job"}
    assert promql.strip_threshold("a - b > 0") == "a - b" and promql.strip_threshold("a < b") == "a < b"
    assert promql.substitute("rate(x{m=~\"$model_name\"}[$__rate_interval])", model_name="a") == 'rate(x{m=~"a"}[1m])'
    with pytest.raises(ValueError):
        promql.substitute("x[$unknown]")


# ---- Grafana provisioning, install script ---------------------------------------------------------------------
def test_grafana_provisioning():
    with open(os.path.join(GRAFANA_DIR, "provisioning", "datasources", "prometheus.yml")) as f:
        ds = yaml.safe_load(f)
    (src,) = ds["datasources"]
    assert ds["apiVersion"] == 1 and src["type"] == "prometheus" and src["url"].startswith("http")
    with open(os.path.join(GRAFANA_DIR, "provisioning", "dashboards", "pagedserve.yml")) as f:
        dash = yaml.safe_load(f)
    (prov,) = dash["providers"]
    assert dash["apiVersion"] == 1 and prov["type"] == "file" and prov["options"]["path"]


def test_install_script_syntax():
    subprocess.run(["bash", "-n", os.path.join(promql.DEPLOY_DIR, "install_prometheus.sh")], check=True)
