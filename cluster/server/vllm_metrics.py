"""``--metrics-compat vllm``: the series a vLLM operator's tools read (vLLM's Grafana dashboard, KEDA scalers, the
production-stack router), under vLLM's names and label names, beside pagedserve's own. Each is a renamed copy of one
of pagedserve's families at collect time (no second measurement), so the two never disagree."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import Metric

COMPAT_MODES = ("vllm", "none")

# pagedserve's family -> vLLM's (vLLM's kv_cache_usage_perc is a fraction in 0..1 too).
VLLM_NAMES = {
    "pagedserve_num_requests_running": "vllm:num_requests_running",
    "pagedserve_num_requests_waiting": "vllm:num_requests_waiting",
    "pagedserve_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
    "pagedserve_cache_config_info": "vllm:cache_config_info",
    "pagedserve_prefix_cache_queries": "vllm:prefix_cache_queries",
    "pagedserve_prefix_cache_hits": "vllm:prefix_cache_hits",
    "pagedserve_num_preemptions": "vllm:num_preemptions",
    "pagedserve_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "pagedserve_request_prefill_time_seconds": "vllm:request_prefill_time_seconds",
    "pagedserve_request_decode_time_seconds": "vllm:request_decode_time_seconds",
    "pagedserve_prompt_tokens": "vllm:prompt_tokens",
    "pagedserve_generation_tokens": "vllm:generation_tokens",
    "pagedserve_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "pagedserve_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "pagedserve_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "pagedserve_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "pagedserve_request_prompt_tokens": "vllm:request_prompt_tokens",
    "pagedserve_request_generation_tokens": "vllm:request_generation_tokens",
    "pagedserve_request_max_generation_tokens": "vllm:request_max_num_generation_tokens",
    "pagedserve_requests_finished": "vllm:request_success",
}
# pagedserve's label -> vLLM's, per family where they differ.
VLLM_LABELS = {
    "pagedserve_requests_finished": {"finish_reason": "finished_reason"},
    "pagedserve_cache_config_info": {"num_blocks": "num_gpu_blocks"},
}


def vllm_copy(fam: Metric) -> Metric | None:
    """``fam`` under vLLM's name and label names; None when vLLM has no such series."""
    name = VLLM_NAMES.get(fam.name)
    if name is None:
        return None
    labels = VLLM_LABELS.get(fam.name, {})
    out = Metric(name, fam.documentation, fam.type, fam.unit)
    for s in fam.samples:
        out.add_sample(name + s.name[len(fam.name):], {labels.get(k, k): v for k, v in s.labels.items()}, s.value,
                       s.timestamp, s.exemplar)
    return out


class VllmCompatCollector:
    """The vLLM-named copies of the families ``sources`` collect (each source: a zero-argument collect)."""

    def __init__(self, sources: Iterable[Callable[[], Iterable[Metric]]]) -> None:
        self.sources = list(sources)

    def collect(self):
        for collect in self.sources:
            for fam in collect():
                copy = vllm_copy(fam)
                if copy is not None:
                    yield copy
