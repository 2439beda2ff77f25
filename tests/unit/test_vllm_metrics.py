"""--metrics-compat vllm: every request series also under vLLM's name and label names, equal to pagedserve's own;
none of them with --metrics-compat none. (tests/deploy/test_metrics_fresh.py reads vLLM's dashboard through a real
Prometheus.)"""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedserve.cluster.server.metrics import GatewayMetrics
from pagedserve.cluster.server.vllm_metrics import VLLM_NAMES, vllm_copy


def _samples(metrics: GatewayMetrics) -> dict[str, float]:
    out = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_vllm_names_carry_the_same_values():
    metrics = GatewayMetrics("m")
    timer = metrics.request("http")
    timer.admitted(12, 100)
    timer.tokens(1)
    timer.tokens(4)
    timer.finished("stop")
    s = _samples(metrics)
    labels = '{model_name="m",protocol="http"}'
    assert s["vllm:prompt_tokens_total" + labels] == s["pagedserve_prompt_tokens_total" + labels] == 12
    assert s["vllm:generation_tokens_total" + labels] == 5
    assert s['vllm:request_success_total{finished_reason="stop",model_name="m",protocol="http"}'] == 1
    assert s['vllm:request_success_total{finished_reason="length",model_name="m",protocol="http"}'] == 0
    assert s["vllm:e2e_request_latency_seconds_count" + labels] == 1
    assert s["vllm:request_max_num_generation_tokens_sum" + labels] == 100
    assert s["vllm:request_time_per_output_token_seconds_count" + labels] == 1
    vllm = {k.split("{")[0] for k in s if k.startswith("vllm:")}
    ours = {k.split("{")[0] for k in s if k.startswith("pagedserve_")}
    ours_of = {v: k for k, v in VLLM_NAMES.items()}
    families = {max((v for v in ours_of if k == v or k.startswith(v + "_")), key=len) for k in vllm}
    assert len(families) == 10  # each of the gateway's own request families (the engines' come from replicas)
    for name in vllm:  # each vLLM series is a copy of one of ours
        family = max((v for v in ours_of if name == v or name.startswith(v + "_")), key=len)
        assert ours_of[family] + name[len(family):] in ours, name
    assert not any(k.startswith("vllm:") for k in _samples(GatewayMetrics("m", compat="none")))
    with pytest.raises(ValueError, match="metrics compat"):
        GatewayMetrics("m", compat="sglang")


def test_engine_families_renamed_with_vllms_labels():
    info = GaugeMetricFamily("pagedserve_cache_config_info", "", labels=["block_size", "num_blocks"])
    info.add_metric(["16", "100"], 1)
    copy = vllm_copy(info)
    assert copy.name == "vllm:cache_config_info" and copy.samples[0].labels == {"block_size": "16",
                                                                              "num_gpu_blocks": "100"}
    hits = CounterMetricFamily("pagedserve_prefix_cache_hits", "", labels=["model_name"])
    hits.add_metric(["m"], 7)
    assert [(s.name, s.value) for s in vllm_copy(hits).samples] == [("vllm:prefix_cache_hits_total", 7)]
    assert vllm_copy(CounterMetricFamily("pagedserve_engine_steps", "")) is None  # vLLM has no such series
