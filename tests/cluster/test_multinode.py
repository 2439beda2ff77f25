"""Two simulated nodes (``ray.cluster_utils.Cluster``): with ``--data-parallel-size 2`` and TP=2 each TP group
lands whole on one node, the second replica on the other, and the gateway spreads requests across both. With one
replica per node, each routing policy over HTTP: prefix-aware keeps each tenant on the replica that holds its prefix,
round-robin alternates, least-loaded serves from both under concurrency (those two on gateways attached to the
replicas, as `pagedserve gateway` attaches); a placement group that fits the free CPUs in total but no one node is
refused at once where the caller asks for one look.
Runs in subprocesses: each needs a Ray cluster of its own, apart from the session's."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def main(model_dir: str) -> None:
    import asyncio

    import ray
    from ray.cluster_utils import Cluster

    from pagedserve.cluster.client import AsyncClient
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.tests.server_thread import ServerThread, add_node

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False})
    add_node(cluster, num_cpus=3)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    srv = ServerThread(EngineArgs(model=model_dir, tensor_parallel_size=2, seed=0), data_parallel_size=2,
                       allow_unauthenticated_ray=True).start()  # a simulated cluster: token auth off
    try:
        async def send():
            async with AsyncClient(srv.target) as c:
                return await asyncio.gather(*[c.generate("class self", max_tokens=8, temperature=0.0)
                                              for _ in range(8)])

        results = asyncio.run(send())
        with srv.client() as c:
            dp = c.model_info().data_parallel_size
        replicas = srv.replicas
        report = {
            # Per replica, the node of each bundle: [engine-core actor (= rank 0 without TP), rank 0, ...].
            "bundle_nodes": [list(ray.util.placement_group_table(r.placement_group)["bundles_to_node_id"].values())
                             for r in replicas],
            "scheduler_nodes": ray.get([r.actor.get_node_id.remote() for r in replicas]),
            "requests": [s.num_requests for s in ray.get([r.actor.get_stats.remote() for r in replicas])],
            "texts": sorted({r.text for r in results}),
            "data_parallel_size": dp,
            "nodes": [n["NodeID"] for n in ray.nodes() if n["Alive"]],
        }
    finally:
        srv.stop()
        ray.shutdown()
        cluster.shutdown()
    print("REPORT " + json.dumps(report))


SYSTEM = {"a": [(7 * i) % 250 + 5 for i in range(96)], "b": [(11 * i) % 250 + 5 for i in range(96)]}  # 6 blocks


def _policy_report(gateway, http_url: str) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import httpx2
    import ray

    replicas = list(gateway.state.engine.replicas)

    def queries() -> list[int]:
        return [ray.get(r.actor.get_stats.remote()).scheduler.prefix_cache_queries for r in replicas]

    def complete(prompt: list[int]) -> None:
        r = httpx2.post(f"{http_url}/v1/completions", timeout=120,
                        json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text

    grew = {}
    for tenant, system in SYSTEM.items():
        complete(system + [3])  # caches the tenant's prefix somewhere
        before = queries()
        with ThreadPoolExecutor(4) as pool:  # concurrent: least-loaded sees load on a replica
            list(pool.map(complete, [system + [q + 10, 4] for q in range(4)]))
        grew[tenant] = [after - b for after, b in zip(queries(), before)]
    return {"nodes": ray.get([r.actor.get_node_id.remote() for r in replicas]), "grew": grew,
            "decisions": dict(gateway.state.engine.picker.decisions)}


def _fragmented() -> dict:
    """Two groups of 0.6 CPU hold one on each one-CPU node; one of 0.5 fits the free CPUs in total (0.8) but no one
    node's (0.4): a look that gives up at once (a rollout's surge) says so, instead of waiting for the timeout."""
    import time

    import ray
    from ray.util.placement_group import remove_placement_group

    from pagedserve.engine.executor.ray_utils import make_placement_group

    holders = [make_placement_group([{"CPU": 0.6}], "holder") for _ in range(2)]
    free = ray.available_resources().get("CPU", 0.0)
    t = time.monotonic()
    try:
        make_placement_group([{"CPU": 0.5}], "fragmented", held_wait_s=0)
        why = None
    except RuntimeError as e:
        why = str(e)
    took = time.monotonic() - t
    for pg in holders:
        remove_placement_group(pg)
    return {"free_total": free, "ask": 0.5, "why": why, "took_s": took}


def policies(model_dir: str) -> None:
    """For each policy on two one-CPU nodes (so one replica per node): per tenant, the prompt tokens each replica
    looked up in its prefix cache while serving the tenant's requests, and the routing decisions. Prefix-aware on
    the server's own gateway while the caches are empty; the others on gateways attached to the same replicas."""
    import ray
    from ray.cluster_utils import Cluster

    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.tests.server_thread import GatewayThread, ServerThread, add_node, free_port

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    add_node(cluster, num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    report = {}
    try:
        srv = ServerThread(EngineArgs(model=model_dir, seed=0, max_model_len=256), data_parallel_size=2,
                           http_port=free_port(), routing_policy="prefix-aware", served_model_name="policies",
                           name_replicas=True, allow_unauthenticated_ray=True).start(timeout=240)
        try:
            report["prefix-aware"] = _policy_report(srv.gateway, srv.http_url)
            for policy in ("round-robin", "least-loaded"):
                with GatewayThread("policies", routing_policy=policy, allow_unauthenticated_ray=True) as gw:
                    report[policy] = _policy_report(gw.gateway, gw.http_url)
        finally:
            srv.stop()
        report["fragmented"] = _fragmented()
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("REPORT " + json.dumps(report))


@pytest.mark.timeout(660)  # past its own subprocess's timeout, which names what hung
def test_each_routing_policy_with_a_replica_on_each_node(model_factory, llama_dir):
    proc = subprocess.run([sys.executable, "-m", "pagedserve.tests.cluster.test_multinode", "policies", llama_dir],
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    report = json.loads(lines[-1][len("REPORT "):])
    for policy in ("prefix-aware", "round-robin", "least-loaded"):
        assert len(set(report[policy]["nodes"])) == 2, (policy, report[policy]["nodes"])
    prefix = report["prefix-aware"]
    for tenant, grew in prefix["grew"].items():  # one replica took every request of the tenant
        assert sorted(grew)[0] == 0 and sorted(grew)[1] > 0, (tenant, grew)
    assert prefix["decisions"]["prefix_hit"] == 8
    assert all(g > 0 for g in report["round-robin"]["grew"]["a"]), report["round-robin"]
    assert report["round-robin"]["decisions"]["round_robin"] == 10
    frag = report["fragmented"]
    assert frag["free_total"] >= frag["ask"], frag  # the precondition: room in total, on no one node
    assert frag["why"] is not None and "on one node" in frag["why"] and "held by placement group(s)" in frag["why"]
    assert frag["took_s"] < 10, frag
    least = report["least-loaded"]
    assert least["decisions"]["least_loaded"] == 10
    assert all(sum(g[i] for g in least["grew"].values()) > 0 for i in range(2)), least  # both replicas served


def test_data_parallel_replicas_on_separate_nodes(model_factory):
    model_dir = model_factory("llama-gqa8")
    proc = subprocess.run([sys.executable, "-m", "pagedserve.tests.cluster.test_multinode", model_dir],
                          capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    report = json.loads(lines[-1][len("REPORT "):])
    assert len(report["nodes"]) == 2 and report["data_parallel_size"] == 2
    first, second = report["bundle_nodes"]
    assert len(set(first)) == 1 and len(set(second)) == 1, "a replica's TP group spans nodes"
    assert first[0] != second[0], "both replicas landed on one node"
    assert report["scheduler_nodes"] == [first[0], second[0]]
    assert all(n > 0 for n in report["requests"]) and sum(report["requests"]) == 8, report["requests"]
    assert len(report["texts"]) == 1  # both replicas answer the same greedy request identically


if __name__ == "__main__":
    if sys.argv[1] == "policies":
        policies(sys.argv[2])
    else:
        main(sys.argv[1])
