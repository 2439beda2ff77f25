"""The router's /metrics families: every live replica's own (scraped from its actor, labelled ``replica``), the
workers-up gauges, the routing decisions and the replicas serving."""
from __future__ import annotations

import logging
from collections.abc import Callable

import ray
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedserve.cluster.runtime.replicas import Replica
from pagedserve.cluster.runtime.routing import ReplicaPicker

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0


def collect_metrics(replicas: list[Replica], tensor_parallel_size: int, picker: ReplicaPicker, num_serving: int,
                    sources: list[Callable[[], list[Metric]]]) -> list[Metric]:
    """``sources``: more families (the autoscaler's). A replica that fails to answer counts its workers down."""
    tp = tensor_parallel_size
    up = GaugeMetricFamily("pagedserve_workers_up", "Model workers (TP ranks) alive, per replica.", labels=["replica"])
    expected = GaugeMetricFamily("pagedserve_workers_expected", "Model workers (TP ranks) configured, per replica.",
                                 labels=["replica"])
    merged: dict[str, Metric] = {}
    for r in replicas:
        label = str(r.index)
        expected.add_metric([label], tp)
        families = None
        if r.alive:
            try:
                families = ray.get(r.actor.get_metrics.remote(), timeout=SCRAPE_TIMEOUT_S)
            except Exception as e:  # a dying replica must not break the scrape
                logger.warning("replica %d metrics unavailable: %s", r.index, e)
        up.add_metric([label], tp if families is not None else 0)
        for fam in families or []:
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for smp in fam.samples:
                out.add_sample(smp.name, {"replica": label, **smp.labels}, smp.value, smp.timestamp)
    decisions = CounterMetricFamily("pagedserve_routing_decisions", "Requests routed, by policy and reason.",
                                    labels=["policy", "reason"])
    for reason, n in list(picker.decisions.items()):
        decisions.add_metric([picker.policy.name, reason], n)
    serving = GaugeMetricFamily("pagedserve_serving_replicas",
                                "Model replicas serving now (scaling, draining and failures change it).")
    serving.add_metric([], num_serving)
    extra = [fam for source in sources for fam in source()]
    return [up, expected, decisions, serving, *extra, *merged.values()]
