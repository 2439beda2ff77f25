"""Ray start-up and placement: shared by the Ray executor and the serving runtime's replicas."""
from __future__ import annotations

import os

import ray
from ray.util.placement_group import PlacementGroup, placement_group

PLACEMENT_TIMEOUT_S = 120


def ensure_ray(address: str | None = None) -> None:
    """Join ``address`` (or RAY_ADDRESS) if given, else start a private local Ray instance.

    A private instance runs without Ray's dashboard: its ten or so processes take ~1 GB and CPU that, on a small
    host, the engine would miss, and nobody else can reach that instance anyway. For the dashboard or job
    submission, start Ray yourself (``ray start --head``) and pass its address.
    """
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False,
                 **({} if address else {"include_dashboard": False}))


def rank_cpus(num_ranks: int, gpu: bool, reserved: float = 0.0) -> float:
    """CPUs a rank asks for: a core, or a share of one where the cluster has fewer cores than ranks
    (``reserved``: CPUs set aside for other actors)."""
    if gpu:
        return 1.0
    share = (ray.cluster_resources().get("CPU", num_ranks) - reserved) / num_ranks
    return max(0.01, min(1.0, int(share * 100) / 100))


def rank_bundle(cpu: float, gpu: bool) -> dict[str, float]:
    return {"GPU": 1, "CPU": cpu} if gpu else {"CPU": cpu}


def make_placement_group(bundles: list[dict[str, float]]) -> PlacementGroup:
    """One replica's resources on one node (a TP group never spans nodes)."""
    pg = placement_group(bundles, strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    return pg
