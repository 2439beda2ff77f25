"""benchmarks/bench_serve.py's latency definitions (vLLM's `bench serve`): TTFT from send to the first chunk, TPOT over
the tokens after the first, ITL every gap between chunks, throughput over the whole run's span."""
from __future__ import annotations

import math

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("serve")


def test_summary_definitions(bench):
    T = bench.RequestTiming
    a = T(sent=0.0, chunks=[0.5, 0.6, 0.8], output_tokens=5)  # the last chunk carried 3 tokens
    b = T(sent=1.0, chunks=[1.2, 2.2], output_tokens=2)
    failed = T(sent=0.5, error="UNAVAILABLE")
    s = bench.summarize([a, b, failed], rate=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["duration_s"] == pytest.approx(2.2)
    assert s["output_tok_s"] == pytest.approx(7 / 2.2) and s["request_throughput"] == pytest.approx(2 / 2.2)
    assert s["ttft_ms"]["mean"] == pytest.approx(350.0)  # (0.5 + 0.2) / 2
    assert s["tpot_ms"]["mean"] == pytest.approx((0.3 / 4 + 1.0 / 1) / 2 * 1e3)
    assert s["itl_ms"]["mean"] == pytest.approx((100 + 200 + 1000) / 3)
    assert s["itl_ms"]["p50"] == pytest.approx(200.0)
    assert s["e2e_ms"]["p50"] == pytest.approx(1000.0)  # both take 0.8 and 1.2 s -> median 1.0 s


def test_fresh_tokens_keep_lengths(bench):
    wl = bench.Workload("w", [[5, 6, 7], [8] * 10], [4, 9])
    a, b = bench.fresh_tokens(wl, 1), bench.fresh_tokens(wl, 2)
    assert [len(p) for p in a.prompts] == [3, 10] and a.output_lens == [4, 9]
    assert a.prompts != b.prompts and all(3 <= t < 32000 for p in a.prompts for t in p)
    assert math.isnan(bench.percentiles([])["p99"])


def test_served_tables_say_when_vllm_met_the_slo_at_no_rate(load_benchmark):
    """Slow enough that vLLM keeps under half its requests within the SLO at every rate: no goodput rate to judge."""
    svv, tables = load_benchmark("serve_vs_vllm"), load_benchmark("serve_tables")

    def side(tok_s: float, met: int) -> dict:
        lat = {"p50": 90.0, "p99": 120.0}
        return {"output_tok_s": tok_s, "ttft_ms": lat, "tpot_ms": lat, "itl_ms": lat, "failed": 0,
                "completed": 128, "slo_met": met, "slo_met_fraction": met / 128, "goodput_req_s": met / 20}

    run = {"rate": "inf", "pagedserve": side(1000.0, 40), "vllm": side(750.0, 10),
           "ratios": {"output_tok_s": 1000 / 750, "ttft_p50": 1.0, "tpot_p50": 1.0, "itl_p50": 1.0, "goodput": 4.0}}
    targets = svv.verdict([run])
    assert targets["goodput_rate"] is None and not targets["met"]
    w = {"slo": {"ttft_ms": 2000.0, "tpot_ms": 100.0}, "loadavg_1min_before_runs": {"min": 1.0, "max": 2.0},
         "requests": 128, "pagedserve_engine_niceness": 0, "date": "2026-11-30", "runs": [run], "targets": targets}
    text = tables.workload_table("bench-llama-58m", "random", w)
    assert "x1.33, goodput n/a" in text and text.endswith("not met.")
