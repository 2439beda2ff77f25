"""Metrics from the first scrape: a real Prometheus scraping a gateway that has served nothing yet returns data for
every dashboard panel's and every alert's PromQL (each labelled series a panel or alert reads exists at zero from
startup), for vLLM's own dashboard too (``--metrics-compat vllm``, the default), and no alert fires on that idle,
healthy server."""
from __future__ import annotations

import os
import shutil
import time

import pytest

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.tests import promql
from pagedserve.tests.server_thread import ServerThread, free_port

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="the `prometheus` binary is missing: run deploy/install_prometheus.sh (Debian package prometheus)")


@pytest.fixture(scope="module")
def fresh(ray_cluster, llama_dir, tmp_path_factory):
    srv = ServerThread(EngineArgs(model=llama_dir, seed=0), metrics_port=free_port()).start()
    prom = promql.LocalPrometheus([f"127.0.0.1:{srv.gateway.metrics_port}"],
                                  str(tmp_path_factory.mktemp("prometheus-fresh")), scrape_interval="1s")
    try:
        prom.start()
        deadline = time.monotonic() + 30
        while len(prom.query('count_over_time(up{job="pagedserve"}[1m])') or []) == 0 or float(
                prom.query('count_over_time(up{job="pagedserve"}[1m])')[0]["value"][1]) < 4:
            assert time.monotonic() < deadline, "the fresh gateway was not scraped four times"
            time.sleep(0.5)  # rate() over [1m] needs two samples; four leave room
        yield prom
    finally:
        prom.stop()
        srv.stop()


def test_every_panel_and_alert_has_data_before_any_request(fresh):
    empty = []
    for q in promql.dashboard_queries():
        expr = promql.substitute(q.expr, model_name=".*", rate_interval="1m", range_="5m")
        if not fresh.query(expr):
            empty.append(f"panel {q.panel}/{q.ref_id}: {expr}")
    for rule in promql.load_alert_rules():
        for signal in promql.alert_signals(rule["expr"]):
            if not fresh.query(signal):
                empty.append(f"alert {rule['alert']}: {signal}")
    assert not empty, "no data on a fresh server:\n" + "\n".join(empty)
    assert fresh.query("sum(pagedserve_request_errors_total) == 0")  # zero, not absent
    assert fresh.query("sum(pagedserve_requests_finished_total) == 0")


def test_every_panel_of_vllms_dashboard_has_data(fresh):
    dashboard = promql.load_dashboard(os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "vllm",
                                                   "grafana.json"))
    queries = promql.dashboard_queries(dashboard)
    assert len(queries) >= 30 and all("vllm:" in q.expr for q in queries)
    # Its model_name variable is label_values(model_name), matched exactly: the served model, as Grafana finds it.
    [model] = {r["metric"]["model_name"] for r in fresh.query("group by (model_name) (vllm:num_requests_running)")}
    empty = [f"panel {q.panel}/{q.ref_id}: {q.expr}" for q in queries
             if not fresh.query(promql.substitute(q.expr, model_name=model, rate_interval="1m", range_="5m"))]
    assert not empty, "no data for vLLM's dashboard:\n" + "\n".join(empty)
    assert fresh.query('sum(vllm:request_success_total{finished_reason="stop"}) == 0')
    assert fresh.query("vllm:num_requests_waiting == 0") and fresh.query("vllm:kv_cache_usage_perc == 0")


def test_no_alert_fires_on_an_idle_server(fresh):
    deadline = time.monotonic() + 10
    while True:
        groups = promql._get(fresh.url + "/api/v1/rules", {})["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r.get("lastEvaluation", "0").startswith("2") for r in rules):
            break
        assert time.monotonic() < deadline, "rules never evaluated"
        time.sleep(0.5)
    assert not [r["name"] for r in rules if r["state"] == "firing"]
    assert all(r.get("health") == "ok" for r in rules), [r.get("lastError") for r in rules]
