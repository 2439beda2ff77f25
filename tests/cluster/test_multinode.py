"""Two simulated nodes (``ray.cluster_utils.Cluster``): with ``--data-parallel-size 2`` and TP=2 each TP group
lands whole on one node, the second replica on the other, and the gateway spreads requests across both.
Runs in a subprocess: it needs a Ray cluster of its own, apart from the session's."""
from __future__ import annotations

import json
import subprocess
import sys


def main(model_dir: str) -> None:
    import asyncio

    import ray
    from ray.cluster_utils import Cluster

    from pagedserve.cluster.client import AsyncClient
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.tests.server_thread import ServerThread

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3})
    cluster.add_node(num_cpus=3)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    srv = ServerThread(EngineArgs(model=model_dir, tensor_parallel_size=2, seed=0), data_parallel_size=2).start()
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
    main(sys.argv[1])
