"""A node lost under load, as an operator meets it: two replicas on two simulated one-CPU nodes
(``ray.cluster_utils.Cluster``), 48 streams running, the node of one replica removed. Every stream completes with
exactly its greedy tokens (those on the lost replica resume on the other), health stays SERVING throughout since
the other replica serves, and once a node joins again the lost replica is placed there and serves again.
Then a scale-in that loses the node of the replica it keeps: the moved streams still complete exactly.
Runs in a subprocess: it needs a Ray cluster of its own, apart from the session's."""
from __future__ import annotations

import json
import subprocess
import sys

STREAMS = 48
MAX_TOKENS = 48


def main(model_dir: str) -> None:
    import asyncio
    import threading
    import time

    import httpx2
    import ray
    from ray.cluster_utils import Cluster

    from pagedserve import LLM, SamplingParams
    from pagedserve.cluster.client import AsyncClient
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.tests.server_thread import ServerThread, free_port

    prompts = [[5 + i, 17, 23 + 3 * i, 9] for i in range(STREAMS)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(model_dir, seed=0).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    srv = ServerThread(EngineArgs(model=model_dir, seed=0), data_parallel_size=2, http_port=free_port(),
                       allow_unauthenticated_ray=True).start(240)  # a simulated cluster: token auth off
    health: list[str] = []
    watching = threading.Event()
    watching.set()

    def watch() -> None:
        with srv.client(timeout=2) as c:
            while watching.is_set():
                status = c.health()
                if not health or health[-1] != status:
                    health.append(status)
                time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    report: dict = {}
    try:
        async def streams(fault) -> list[list[int]]:
            async with AsyncClient(srv.target) as client:
                async def one(i: int, started: asyncio.Event) -> list[int]:
                    tokens: list[int] = []
                    async for d in client.generate_stream(prompts[i], max_tokens=MAX_TOKENS, temperature=0.0,
                                                          ignore_eos=True):
                        tokens += d.token_ids
                        started.set()
                    return tokens

                flags = [asyncio.Event() for _ in range(STREAMS)]
                tasks = [asyncio.create_task(one(i, flags[i])) for i in range(STREAMS)]
                await asyncio.gather(*[f.wait() for f in flags])  # every stream is mid-way
                await fault()
                return list(await asyncio.gather(*tasks))

        def node_of(replica) -> str:
            return ray.get(replica.actor.get_node_id.remote(), timeout=30)

        async def lose_node() -> None:
            victim = node_of(srv.replicas[1])
            await asyncio.to_thread(cluster.remove_node, next(n for n in nodes if n.node_id == victim))

        t0 = time.monotonic()
        got = asyncio.run(streams(lose_node))
        report["lost_node_exact"] = sum(g == e for g, e in zip(got, expected))
        report["health_during_loss"] = list(health)
        nodes.append(cluster.add_node(num_cpus=1))
        while time.monotonic() - t0 < 180:
            with srv.client() as c:
                if c.model_info().data_parallel_size == 2:
                    break
            time.sleep(0.5)
        report["replaced_after_s"] = round(time.monotonic() - t0, 1)
        with srv.client() as c:
            report["replicas_after_rejoin"] = c.model_info().data_parallel_size

        async def scale_in_losing_the_kept_node() -> None:
            async with httpx2.AsyncClient(base_url=srv.http_url, timeout=300) as http:
                # Drain nothing, move everything: the moved requests and the kept replica's node fail together.
                scale = asyncio.create_task(http.post("/scale_elastic_ep",
                                                      json={"new_data_parallel_size": 1, "drain_timeout": 0}))
                states = srv.gateway.state.engine.replicas
                while not any(r.retiring for r in states):
                    await asyncio.sleep(0.02)
                keep = next(r for r in states if not r.retiring).replica
                await asyncio.to_thread(cluster.remove_node, next(n for n in nodes if n.node_id == node_of(keep)))
                report["scale_in_status"] = (await scale).status_code

        nodes.append(cluster.add_node(num_cpus=1))  # room for the kept replica to come back
        got = asyncio.run(streams(scale_in_losing_the_kept_node))
        report["scale_in_exact"] = sum(g == e for g, e in zip(got, expected))
        report["health"] = list(health)
    finally:
        watching.clear()
        watcher.join()
        srv.stop()
        ray.shutdown()
        cluster.shutdown()
    print("REPORT " + json.dumps(report))


def test_a_lost_node_under_load(model_factory):
    model_dir = model_factory("gpt2")
    proc = subprocess.run([sys.executable, "-m", "pagedserve.tests.cluster.test_lost_node", model_dir],
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    report = json.loads(lines[-1][len("REPORT "):])
    assert report["lost_node_exact"] == STREAMS, report
    assert report["health_during_loss"] == ["SERVING"], report  # never NOT_SERVING while one replica serves
    assert report["replicas_after_rejoin"] == 2 and report["replaced_after_s"] < 120, report
    assert report["scale_in_status"] == 200 and report["scale_in_exact"] == STREAMS, report


if __name__ == "__main__":
    main(sys.argv[1])
