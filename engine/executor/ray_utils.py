"""Ray start-up and placement: shared by the Ray executor and the serving runtime's replicas."""
from __future__ import annotations

import itertools
import os
import time

import ray
from ray._private.state import available_resources_per_node
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

PLACEMENT_TIMEOUT_S = 120  # for resources that may yet come (a node joining)
HELD_CHECK_S = 5.0  # after this, resources held by other placement groups are reported rather than waited for
_names = itertools.count()


# Ray starts its workers at niceness 15 unless told: here they are the engine and its tensor-parallel ranks, the
# server's main work, which would otherwise lose the CPU to anything at the default niceness (its own gateway).
WORKER_NICENESS_ENV = {"RAY_worker_niceness": "0"}


def ray_env() -> dict[str, str]:
    """The environment for a Ray instance this process starts: this one's, with workers at niceness 0 unless the
    operator set it."""
    return {**WORKER_NICENESS_ENV, **os.environ}


def ensure_ray(address: str | None = None) -> None:
    """Join ``address`` (or RAY_ADDRESS) if given, else start a private local Ray instance.

    A private instance runs without Ray's dashboard: its ten or so processes take ~1 GB and CPU that, on a small
    host, the engine would miss, and nobody else can reach that instance anyway. For the dashboard or job
    submission, start Ray yourself (``ray start --head``) and pass its address.
    """
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        for key, value in WORKER_NICENESS_ENV.items():  # read by a raylet started here; no effect on a joined one
            os.environ.setdefault(key, value)
        # "local": a new instance, never one some other process left on this host (ray.init's default joins that,
        # or fails where it finds several).
        ray.init(address=address or "local", ignore_reinit_error=True, log_to_driver=False,
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


def make_placement_group(bundles: list[dict[str, float]], role: str, detached: bool = False,
                         timeout: float = PLACEMENT_TIMEOUT_S,
                         held_wait_s: float | None = HELD_CHECK_S) -> PlacementGroup:
    """One engine's resources on one node (a TP group never spans nodes). ``role`` names it, so that an engine
    that cannot be placed can say which others hold the resources. Raises RuntimeError saying why, within
    ``held_wait_s`` when other placement groups hold what it needs, else after ``timeout`` seconds.
    ``detached``: it outlives the process that made it (removed with ``remove_placement_group``).
    ``held_wait_s`` None: wait the whole ``timeout`` even when others hold the resources (a scale-out: the pending
    group is what makes a Ray autoscaler add a node); 0: give up at the first look (a rollout's surge, which
    replaces in place instead)."""
    name = f"pagedserve-{role}-pid{os.getpid()}-{next(_names)}"
    pg = placement_group(bundles, strategy="STRICT_PACK", name=name, lifetime="detached" if detached else None)
    start = time.monotonic()
    while True:
        try:
            ray.get(pg.ready(), timeout=1.0)
            return pg
        except ray.exceptions.GetTimeoutError:
            waited = time.monotonic() - start
            why = _unplaceable(bundles, name) if held_wait_s is not None and waited >= held_wait_s else None
            if why is None and waited > timeout:
                why = _not_placed(bundles, name, timeout)
            if why is not None:
                remove_placement_group(pg)
                raise RuntimeError(why) from None


def _not_placed(bundles: list[dict[str, float]], name: str, timeout: float) -> str:
    """What ``bundles`` ask for against what the cluster has, for one that waited ``timeout`` s in vain."""
    keys = sorted({k for b in bundles for k in b})
    need = {k: sum(b.get(k, 0.0) for b in bundles) for k in keys}
    total, free = ray.cluster_resources(), ray.available_resources()
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    most = {k: max((r.get(k, 0.0) for r in nodes), default=0.0) for k in keys}
    return (f"{name} was not placed in {timeout:g} s: it needs {_amounts(need)} on one node; the cluster has "
            f"{_amounts({k: total.get(k, 0.0) for k in keys})} ({_amounts({k: free.get(k, 0.0) for k in keys})} "
            f"free), no more than {_amounts(most)} on any of its {len(nodes)} node(s). Add a node with those "
            "resources, or ask for less (--tensor-parallel-size, --data-parallel-size)")


def _amounts(resources: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in resources.items())


def _unplaceable(bundles: list[dict[str, float]], name: str) -> str | None:
    """Why the bundles cannot be placed now, if no node has room for them all (they go on one node) and other
    placement groups hold what they need; else None (wait)."""
    need = {k: v for k in ("CPU", "GPU") if (v := sum(b.get(k, 0.0) for b in bundles)) > 0}
    nodes = list(available_resources_per_node().values())
    if any(all(v <= free.get(k, 0.0) + 1e-9 for k, v in need.items()) for free in nodes):
        return None
    total, free = ray.cluster_resources(), ray.available_resources()
    holders = []
    for pg in placement_group_table().values():
        if pg["state"] != "CREATED" or pg["name"] == name:
            continue
        held = {k: sum(b.get(k, 0.0) for b in pg["bundles"].values()) for k in need}
        if any(held.values()):
            amounts = ", ".join(f"{v:g} {k}" for k, v in held.items() if v)
            holders.append(f"{pg['name'] or pg['placement_group_id']} ({amounts})")
    if not holders:
        return None
    wants = ", ".join(f"{need[k]:g} {k} on one node (the cluster has {total.get(k, 0.0):g}, {free.get(k, 0.0):g} "
                      f"free, at most {max((n.get(k, 0.0) for n in nodes), default=0.0):g} on any node)"
                      for k in need)
    return (f"cannot place {name}: it needs {wants}; held by placement group(s) {'; '.join(holders)}. "
            "Release those engines (LLM.shutdown(), `with LLM(...)`, or dropping them) or add resources.")
