"""A node lost under load, as an operator meets it: two replicas on two simulated one-CPU nodes
(``ray.cluster_utils.Cluster``), 48 streams running, the node of one replica removed. Every stream completes with
exactly its greedy tokens (those on the lost replica resume on the other), health stays SERVING throughout since
the other replica serves, and once a node joins again the lost replica is placed there and serves again.
Then a scale-in that loses the node of the replica it keeps: the moved streams still complete exactly. A scale-out
beyond the cluster's room waits for the node that joins (as a Ray autoscaler would add one). Last, a rollout to new
weights that loses the node of a replica it has not replaced yet: every stream completes (one moved mid-way to a new
replica mixes the two models' tokens, as it must) and afterwards every request answers from the new weights.
Runs in a subprocess: it needs a Ray cluster of its own, apart from the session's."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedserve.tests.utils import make_model

STREAMS = 48
MAX_TOKENS = 48


def main(model_dir: str, new_dir: str) -> None:
    import asyncio
    import logging
    import time

    import httpx2
    import ray
    from ray.cluster_utils import Cluster

    from pagedserve import LLM, SamplingParams
    from pagedserve.cluster.client import AsyncClient
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.tests.server_thread import HealthWatch, ServerThread, add_node, free_port

    # The server's decisions with their times, in the stderr tail a failure shows.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    start = time.monotonic()
    prompts = [[5 + i, 17, 23 + 3 * i, 9] for i in range(STREAMS)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(model_dir, seed=0).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

    phases: dict[str, float] = {}

    def phase(name: str) -> None:
        phases[name] = round(time.monotonic() - start, 1)

    phase("expected")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [add_node(cluster, num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    srv = ServerThread(EngineArgs(model=model_dir, seed=0), data_parallel_size=2, http_port=free_port(),
                       allow_unauthenticated_ray=True).start(240)  # a simulated cluster: token auth off
    phase("serving")
    watch = HealthWatch(srv).start()
    health = watch.seen
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
        nodes.append(add_node(cluster, num_cpus=1))
        while time.monotonic() - t0 < 180:
            with srv.client() as c:
                if c.model_info().data_parallel_size == 2:
                    break
            time.sleep(0.5)
        report["replaced_after_s"] = round(time.monotonic() - t0, 1)
        phase("lost_and_replaced")
        with srv.client() as c:
            report["replicas_after_rejoin"] = c.model_info().data_parallel_size

        async def scale_in_losing_the_kept_node() -> None:
            async with httpx2.AsyncClient(base_url=srv.http_url, timeout=300) as http:
                # Drain nothing, move everything: the moved requests and the kept replica's node fail together.
                scale = asyncio.create_task(http.post("/scale_elastic_ep",
                                                      json={"new_data_parallel_size": 1, "drain_timeout": 0}))
                states = srv.gateway.state.engine.replicas
                # The retiring replica leaves the list once its actor ends, which can come between two looks: then
                # the node goes after the moved streams reached the kept replica, and they must still end exactly.
                while not any(r.retiring for r in states) and len(states) > 1:
                    await asyncio.sleep(0.005)
                keep = next(r for r in states if not r.retiring)
                await asyncio.to_thread(cluster.remove_node, next(n for n in nodes if n.node_id == node_of(keep)))
                report["scale_in_status"] = (await scale).status_code

        nodes.append(add_node(cluster, num_cpus=1))  # room for the kept replica to come back
        got = asyncio.run(streams(scale_in_losing_the_kept_node))
        report["scale_in_exact"] = sum(g == e for g, e in zip(got, expected))
        phase("scale_in")

        async def scale_out_waiting_for_a_node() -> None:
            """One replica and one free node: a scale-out to 3 waits for the node a Ray autoscaler would add."""
            async with httpx2.AsyncClient(base_url=srv.http_url, timeout=300) as http:
                scale = asyncio.create_task(http.post("/scale_elastic_ep", json={"new_data_parallel_size": 3}))
                await asyncio.sleep(8)  # past the quick check for resources other groups hold
                report["scale_out_pending"] = not scale.done()
                nodes.append(add_node(cluster, num_cpus=1))  # main thread: it sets signal handlers
                report["scale_out_status"] = (await scale).status_code

        asyncio.run(scale_out_waiting_for_a_node())
        with srv.client() as c:
            report["replicas_after_scale_out"] = c.model_info().data_parallel_size
        phase("scale_out")

        async def rollout_losing_a_node() -> None:
            """A rollout to new weights (no room to surge: each old replica drained, then replaced in place) that
            loses the node of an old replica it has not reached yet."""
            states = srv.gateway.state.engine.replicas
            first, *_, last = srv.gateway.state.scaler.replicas  # the rollout replaces them in this order

            def state(index: int):
                return next((r for r in states if r.index == index), None)

            async with httpx2.AsyncClient(base_url=srv.http_url, timeout=600) as http:
                rollout = asyncio.create_task(http.post("/rollout", json={"model": new_dir, "drain_timeout": 5}))
                # An idle replica is retiring for only milliseconds before it leaves the list: wait for either.
                while (s := state(first.index)) is not None and not s.retiring:
                    await asyncio.sleep(0.02)
                target = state(last.index)
                assert target is not None and not target.retiring, (
                    f"the rollout reached replica {last.index} before its node could be lost: "
                    f"{[(r.index, r.retiring, r.alive, r.gone) for r in states]}")
                await asyncio.to_thread(cluster.remove_node, next(n for n in nodes if n.node_id == node_of(last)))
                nodes.append(add_node(cluster, num_cpus=1))  # main thread: it sets signal handlers
                response = await rollout
                report["rollout_status"] = response.status_code
                report["rollout_replicas"] = response.json().get("num_replicas")

        got = asyncio.run(streams(rollout_losing_a_node))
        report["rollout_complete"] = sum(len(g) == MAX_TOKENS for g in got)
        phase("rollout")
        new = [o.outputs[0].token_ids for o in LLM(new_dir, seed=0).generate(
            [{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)]
        with srv.client() as c:
            report["answers_from_new_weights"] = [
                list(c.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True).completions[0].token_ids)
                for p in prompts[:4]] == new
    finally:
        report["health"] = list(health)
        report["phases_s"] = phases
        watch.stop()
        srv.stop()
        ray.shutdown()
        cluster.shutdown()
    print("REPORT " + json.dumps(report))


@pytest.mark.timeout(960)  # past its own subprocess's timeout, which names what hung
def test_a_lost_node_under_load(model_factory, tokenizer_dir, tmp_path):
    model_dir = model_factory("gpt2")
    new_dir = make_model(str(tmp_path / "v2"), "gpt2", seed=1, tokenizer_dir=tokenizer_dir)
    proc = subprocess.run([sys.executable, "-m", "pagedserve.tests.cluster.test_lost_node", model_dir, new_dir],
                          capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    report = json.loads(lines[-1][len("REPORT "):])
    print("lost node:", report)
    assert report["lost_node_exact"] == STREAMS, report
    assert report["health_during_loss"] == ["SERVING"], report  # never NOT_SERVING while one replica serves
    assert report["replicas_after_rejoin"] == 2 and report["replaced_after_s"] < 120, report
    assert report["scale_in_status"] == 200 and report["scale_in_exact"] == STREAMS, report
    assert report["scale_out_pending"] and report["scale_out_status"] == 200, report
    assert report["replicas_after_scale_out"] == 3, report
    assert report["rollout_status"] == 200 and report["rollout_replicas"] == 3, report
    assert report["rollout_complete"] == STREAMS and report["answers_from_new_weights"], report


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
