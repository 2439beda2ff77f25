"""The dashboard and the alert rules against a real Prometheus scraping a real gateway: a known load, then every
panel query and every alert signal returns data, and the counters Prometheus stored equal what the clients saw."""
from __future__ import annotations

import math
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagedserve.cluster.client import Client, GenerateResult, accumulate
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.tests import promql
from pagedserve.tests.server_thread import ServerThread, free_port
from pagedserve.tests.utils import random_prompts

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="the `prometheus` binary is missing: run deploy/install_prometheus.sh (Debian package prometheus)")

SCRAPE = "1s"
MODEL = ".*"  # the $model_name variable as "All"
PREFIX = "def class return import self value the of data paged block cache "  # ~50 tokens
NUM_GPU_BLOCKS = 12  # tight enough that the burst preempts (recompute and, for n=2, swap)
LONG = 160  # max_tokens of the aborted and the cancelled streams: long enough to be stopped mid-way, short
#             enough that prompt + LONG fits the 12 blocks (192 tokens)


def _generate(target: str, prompt, kw: dict) -> GenerateResult:
    with Client(target) as c:
        return c.generate(prompt, **kw)


def _invalid_argument(c: Client, kw: dict) -> int:
    """A request the gateway rejects before admission: counted in errors_total{code} only."""
    with pytest.raises(grpc.RpcError) as err:
        c.generate("x", **kw)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return 1


def _next_scrape(prom: promql.LocalPrometheus) -> None:
    """Wait until Prometheus has scraped the gateway after now."""
    t = time.time()
    _wait(lambda: (_scalar(prom, 'timestamp(up{job="pagedserve"})') or 0) > t, 10, "no scrape")


def _send_load(srv: ServerThread, prom: promql.LocalPrometheus) -> dict:
    """The known load, in waves a scrape apart (a labelled series only exists from its first observation on,
    so rate() needs a scrape after that and one after the next wave); returns what the clients observed."""
    results: list[GenerateResult] = []
    errors = 0
    with srv.client() as c:
        # Prefix caching: the same prompt twice, one after the other.
        for _ in range(2):
            results.append(c.generate(PREFIX, max_tokens=8, temperature=0.0))
            errors += _invalid_argument(c, dict(top_p=1.5))  # one error in each wave: the error rate > 0
            _next_scrape(prom)
    assert results[1].cached_prompt_tokens > 0

    # A concurrent burst over a 12-block KV cache: n=2 sampling, stop strings, long greedy requests.
    cases = []
    for i in range(4):
        cases.append((PREFIX[: 20 + 8 * i], dict(n=2, temperature=0.8, seed=i, max_tokens=32, ignore_eos=True)))
        cases.append((PREFIX[4 * i:], dict(temperature=0.0, max_tokens=24, stop=["e", "a "])))
        cases.append((random_prompts(1, seed=i, max_len=50)[0], dict(temperature=0.0, max_tokens=40,
                                                                     ignore_eos=True)))
    with ThreadPoolExecutor(len(cases)) as ex:
        results += list(ex.map(lambda pk: _generate(srv.target, *pk), cases))
    _next_scrape(prom)

    with srv.client() as c:
        errors += _invalid_argument(c, dict(temperature=-1.0))

        # Abort RPC: the stream ends normally with finish_reason abort and usage, so its counts are exact.
        aborted = GenerateResult("", [])
        for n, resp in enumerate(c.stream("class self", request_id="to-abort", temperature=0.0, max_tokens=LONG,
                                          ignore_eos=True)):
            accumulate(aborted, resp)
            if n == 1:
                assert c.abort(resp.request_id)
        assert aborted.completions[0].finish_reason == "abort" and aborted.prompt_tokens > 0

        # A stream the client cancels after its first tokens: admitted (prompt counted), tokens the gateway
        # built before the cancel landed are counted even if the client never read them.
        ids = c.tokenize("paged block cache value")
        call = c.stream(ids, temperature=0.0, max_tokens=LONG, ignore_eos=True)
        received = len(next(call).completions[0].token_ids)
        call.cancel()

    finished = {}
    for r in results:
        reasons = {comp.finish_reason for comp in r.completions}
        assert len(reasons) == 1, reasons  # n=2 cases both end by length, so the request's reason is clear
        reason = reasons.pop()
        finished[reason] = finished.get(reason, 0) + 1
    finished["abort"] = 2
    return dict(
        finished=finished,
        errors={"INVALID_ARGUMENT": errors},
        prompt_tokens=sum(r.prompt_tokens for r in results) + aborted.prompt_tokens + len(ids),
        generation_tokens=sum(r.completion_tokens for r in results) + aborted.completion_tokens,
        cancelled_received=received,
        cancelled_max=LONG,
        requests=len(results) + 2,
    )


@pytest.fixture(scope="module")
def stack(ray_cluster, llama_dir, tmp_path_factory):
    srv = ServerThread(EngineArgs(model=llama_dir, seed=0, num_gpu_blocks_override=NUM_GPU_BLOCKS),
                       metrics_port=free_port(), enable_prompt_tokens_details=True).start()
    prom = promql.LocalPrometheus([f"127.0.0.1:{srv.gateway.metrics_port}"],
                                  str(tmp_path_factory.mktemp("prometheus")), scrape_interval=SCRAPE)
    try:
        prom.start()
        _wait(lambda: prom.query('up{job="pagedserve"} == 1'), 20, "the gateway is never scraped")
        sent = _send_load(srv, prom)
        # Every counter the load moved has reached Prometheus once the finished total has (the gateway counts
        # tokens before it sends them); the errors and the cancel land just after: wait for those too.
        _wait(lambda: _scalar(prom, "sum(pagedserve_requests_finished_total)") == sent["requests"]
              and _scalar(prom, "sum(pagedserve_request_errors_total)") == sum(sent["errors"].values()), 20,
              "the load's counters never reached Prometheus")
        time.sleep(2.5)  # two more scrapes: rate() over the last points sees the end of the load
        yield srv, prom, sent
    finally:
        prom.stop()
        srv.stop()


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(what)


def _scalar(prom, expr: str) -> float | None:
    res = prom.query(expr)
    return float(res[0]["value"][1]) if res else None


def _by(prom, expr: str, label: str) -> dict[str, float]:
    """Non-zero series by label value (every known label value has a series at zero from startup)."""
    return {r["metric"].get(label, ""): float(r["value"][1]) for r in prom.query(expr) if float(r["value"][1])}


def _rfc3339(ts: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(ts[:26].rstrip("Z") + "+00:00").timestamp() if ts[0] != "0" else 0.0


def _values(result: list[dict]) -> list[float]:
    return [float(r["value"][1]) for r in result]


def test_counters_equal_the_load(stack):
    _, prom, sent = stack
    assert _by(prom, "sum by (finish_reason) (pagedserve_requests_finished_total)", "finish_reason") == \
        {k: float(v) for k, v in sent["finished"].items()}
    assert _by(prom, "sum by (code) (pagedserve_request_errors_total)", "code") == \
        {k: float(v) for k, v in sent["errors"].items()}
    assert _scalar(prom, "sum(pagedserve_prompt_tokens_total)") == sent["prompt_tokens"]
    gen = _scalar(prom, "sum(pagedserve_generation_tokens_total)")
    lo = sent["generation_tokens"] + sent["cancelled_received"]
    assert lo <= gen <= sent["generation_tokens"] + sent["cancelled_max"], (gen, sent)
    # Histograms count each request once: admitted ones in the prompt-length histogram, completed ones
    # (stop/length) in end-to-end latency and generation length.
    completed = sent["finished"].get("stop", 0) + sent["finished"].get("length", 0)
    assert _scalar(prom, "sum(pagedserve_request_prompt_tokens_count)") == sent["requests"]
    assert _scalar(prom, "sum(pagedserve_request_prompt_tokens_sum)") == sent["prompt_tokens"]
    assert _scalar(prom, "sum(pagedserve_e2e_request_latency_seconds_count)") == completed
    assert _scalar(prom, "sum(pagedserve_request_generation_tokens_count)") == completed
    # The scheduler side saw the same requests, hit the prefix cache, and preempted under the tight KV cache.
    assert _scalar(prom, "sum(pagedserve_request_queue_time_seconds_count)") == sent["requests"]
    assert _scalar(prom, "sum(pagedserve_prefix_cache_hits_total)") > 0
    assert _scalar(prom, "sum(pagedserve_num_preemptions_total)") > 0
    assert _scalar(prom, "sum(pagedserve_workers_up) - sum(pagedserve_workers_expected)") == 0
    cfg = prom.query("pagedserve_cache_config_info")
    assert cfg and cfg[0]["metric"]["num_blocks"] == str(NUM_GPU_BLOCKS)


def test_every_dashboard_query_has_data(stack):
    _, prom, _ = stack
    queries = promql.dashboard_queries()
    assert len(queries) > 30
    empty, no_value = [], []
    for q in queries:
        expr = promql.substitute(q.expr, model_name=MODEL, rate_interval="1m", range_="5m")
        res = prom.query(expr)
        if not res:
            empty.append(f"{q.panel}/{q.ref_id}: {expr}")
        elif not any(math.isfinite(v) for v in _values(res)):
            no_value.append(f"{q.panel}/{q.ref_id}: {expr} -> {res}")
    assert not empty, "panel queries with no data:\n" + "\n".join(empty)
    assert not no_value, "panel queries with only NaN/Inf:\n" + "\n".join(no_value)


def test_dashboard_variables_resolve(stack):
    srv, prom, _ = stack
    for name, q in promql.variable_queries().items():
        # label_values(metric, label) -> the label's values on that metric's series
        metric, label = [x.strip() for x in q[q.index("(") + 1:q.rindex(")")].split(",")]
        values = {r["metric"][label] for r in prom.query(metric)}
        assert values, f"variable {name}: {q} has no values"
    model = srv.gateway.state.model.name
    # The panels filtered to the one model (not "All") still have data.
    q = next(q for q in promql.dashboard_queries() if q.panel == "Time to first token")
    assert prom.query(promql.substitute(q.expr, model_name=model))
    assert not prom.query(promql.substitute(q.expr, model_name="no-such-model"))


def test_every_alert_signal_has_data(stack):
    _, prom, _ = stack
    missing = []
    for rule in promql.load_alert_rules():
        for signal in promql.alert_signals(rule["expr"]):
            if not prom.query(signal):
                missing.append(f"{rule['alert']}: {signal}")
    assert not missing, "alert signals with no data:\n" + "\n".join(missing)


def test_rules_load_and_evaluate(stack):
    _, prom, _ = stack

    def rules():
        groups = promql._get(prom.url + "/api/v1/rules", {})["groups"]
        return {r["name"]: r for g in groups for r in g["rules"]}

    assert set(rules()) == {r["alert"] for r in promql.load_alert_rules()}
    # evaluated at least once since the load ended (the evaluation interval is the 1 s scrape interval)
    t = time.time()
    _wait(lambda: all(_rfc3339(r["lastEvaluation"]) > t for r in rules().values()), 10, "rules not evaluated")
    rules = rules()
    bad = {n: r.get("lastError") for n, r in rules.items() if r.get("health") != "ok"}
    assert not bad, bad
    firing = [n for n, r in rules.items() if r["state"] == "firing"]
    assert not firing, f"alerts firing on a healthy server: {firing}"


def test_label_names_exist(stack):
    """Every label a query matches on or aggregates by exists in the scraped data (catches `by (phse)`)."""
    _, prom, _ = stack
    known = set(promql._get(prom.url + "/api/v1/labels", {})) | {"le"}
    exprs = [q.expr for q in promql.dashboard_queries()] + [r["expr"] for r in promql.load_alert_rules()]
    unknown = {(lbl, e) for e in exprs for lbl in promql.label_names(e) if lbl not in known}
    assert not unknown, unknown


def test_render_dashboard_png(stack, tmp_path):
    """benchmarks/bench_render_dashboard.py draws the key panels from this Prometheus into a PNG."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_dashboard",
                                                  f"{promql.DEPLOY_DIR}/../benchmarks/bench_render_dashboard.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    _, prom, _ = stack
    end = time.time()
    out = render.render(prom.url, end - 120, end, 1.0, 1.0, str(tmp_path / "d.png"),
                        panels=["Token throughput", "Prompt length"])
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    panel = next(p for p in promql.iter_panels(promql.load_dashboard()) if p["title"] == "Token throughput")
    data = render.fetch(prom.url, panel, end - 120, end, 1.0, dict(model_name=".*", rate_interval="4s"))
    assert data and any(v > 0 for _, _, vs in data for v in vs)  # the drawn series carry the load
