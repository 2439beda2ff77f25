"""benchmarks/bench_fairness.py's figures (issue #69): tokens per tenant per window (prompt tokens at the first token,
output tokens as they come), Jain's index of the weight-normalized tokens, the weighted share ratio, the flood's
workload, and the targets read from a result."""
from __future__ import annotations

import math

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("fairness")


def test_jains_index(bench):
    assert bench.jain([5.0, 5.0]) == pytest.approx(1.0)
    assert bench.jain([1.0, 0.0]) == pytest.approx(0.5)
    assert bench.jain([2.0, 1.0]) == pytest.approx(0.9)
    assert math.isnan(bench.jain([0.0, 0.0]))


def test_tokens_fall_in_their_windows(bench):
    c = bench.Rec("C", prompt_len=10, sent=100.0, first=100.5, chunks=[(100.5, 1), (101.2, 3), (103.9, 2)])
    d = bench.Rec("D", prompt_len=4, sent=99.0, first=102.5, chunks=[(102.5, 1), (105.0, 9)])  # the last: past the end
    lost = bench.Rec("C", prompt_len=7, sent=104.0)  # cancelled before its first token: nothing served
    w = bench.window_tokens([c, d, lost], ["C", "D"], start=100.0, window=2.0, n=2)
    assert w == [{"C": 10 + 1 + 3, "D": 0}, {"C": 2, "D": 4 + 1}]
    assert c.ttft == pytest.approx(0.5) and c.output_tokens == 6


def test_shares_normalize_by_weight(bench):
    windows = [{"C": 200, "D": 100}, {"C": 100, "D": 100}]
    s = bench.shares(windows, {"C": 2.0, "D": 1.0})
    assert s["windows"][0]["jain"] == pytest.approx(1.0)  # 2:1 tokens at weights 2:1 is fair
    assert s["windows"][1]["share"]["C"] == pytest.approx(0.5)
    assert s["ratio_overall"] == pytest.approx(1.5)
    assert s["jain_mean"] == pytest.approx((1.0 + 0.9) / 2) and s["jain_min"] == pytest.approx(0.9)


def test_the_flood_at_full_and_reduced_scale(bench):
    full = bench.flood_jobs(1.0)
    a = [j for j in full if j.tenant == "A"]
    b = [j for j in full if j.tenant == "B"]
    assert (len(a), len(b)) == (300, 20)
    assert all(j.at == 0 for j in a) and b[0].at == pytest.approx(2.0) and b[-1].at > 10
    assert sum(len(j.prompt) for j in a) / 300 > 3 * sum(len(j.prompt) for j in b) / 20
    assert all(j.max_tokens == 16 for j in b) and sum(j.max_tokens for j in a) / 300 > 32
    assert [j.prompt for j in full] == [j.prompt for j in bench.flood_jobs(1.0)]  # seeded
    small = bench.flood_jobs(0.1)
    assert [sum(j.tenant == t for j in small) for t in "AB"] == [30, 4]


def test_targets(bench):
    def side(ratio_p95: float, jain: float, ratio: float, tok_s: float, steps: float) -> dict:
        return {"flood": {"ratios": {"b_ttft_p95": ratio_p95, "output_tok_s": tok_s}},
                "backlog": {"equal": {"tokens": {"jain_mean": jain}}, "weighted": {"tokens": {"ratio_overall": ratio}}},
                "priority": {"extra_steps": steps}}

    rows = bench.verdict({"1": side(0.05, 0.99, 2.1, 0.98, 1.5), "2": side(0.3, 0.9, 2.3, 0.95, 2.5)})
    assert [r["met"] for r in rows if r["replicas"] == 1] == [True] * 5
    assert [r["met"] for r in rows if r["replicas"] == 2] == [False] * 5
