"""Two replicas behind one gateway, over HTTP, with each routing policy: prefix-aware sends every request of a tenant
to the replica that holds its prefix (seen in the replicas' own prefix-cache counters), round-robin alternates, and
a session sticks to its replica until that replica dies (killed with ray.kill), then moves at once."""
from __future__ import annotations

import httpx2
import pytest
import ray

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.tests.server_thread import ServerThread, free_port

SYSTEM = {"a": [(7 * i) % 250 + 5 for i in range(96)], "b": [(11 * i) % 250 + 5 for i in range(96)]}  # 6 blocks


def _serve(llama_dir: str, policy: str) -> ServerThread:
    return ServerThread(EngineArgs(model=llama_dir, seed=0, max_model_len=256), data_parallel_size=2,
                        http_port=free_port(), routing_policy=policy).start()


def _complete(srv: ServerThread, prompt: list[int], session: str | None = None) -> None:
    headers = {"x-session-id": session} if session else {}
    r = httpx2.post(f"{srv.http_url}/v1/completions", timeout=60, headers=headers,
                    json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def _queries(srv: ServerThread) -> list[int]:
    """Prompt tokens each replica looked up in its prefix cache so far."""
    return [ray.get(r.actor.get_stats.remote()).scheduler.prefix_cache_queries for r in srv.replicas]


def _decisions(srv: ServerThread) -> dict[str, int]:
    return dict(srv.gateway.state.engine.picker.decisions)


def test_prefix_aware_keeps_each_tenant_on_the_replica_holding_its_prefix(ray_cluster, llama_dir):
    srv = _serve(llama_dir, "prefix-aware")
    try:
        for tenant, system in SYSTEM.items():
            _complete(srv, system + [3])  # the first request caches the tenant's prefix somewhere
            before = _queries(srv)
            for q in range(4):
                _complete(srv, system + [q + 10, 4])
            grew = [after - b for after, b in zip(_queries(srv), before)]
            assert sorted(grew)[0] == 0 and sorted(grew)[1] > 0, (tenant, grew)  # one replica took them all
        assert _decisions(srv)["prefix_hit"] == 8
        # A session sticks; when its replica dies it moves to the other one at once.
        _complete(srv, [9, 9, 9], session="s1")
        _complete(srv, [8, 8, 8], session="s1")
        assert _decisions(srv)["affinity"] == 1
        engine = srv.gateway.state.engine
        home = engine.replicas[engine.picker._sessions["s1"]]
        ray.kill(home.actor, no_restart=True)
        _complete(srv, [7, 7, 7], session="s1")
        assert _decisions(srv)["affinity_fallback"] == 1
        assert engine.picker._sessions["s1"] != home.index
    finally:
        srv.stop()


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded"])
def test_load_policies_serve_from_both_replicas(ray_cluster, llama_dir, policy):
    srv = _serve(llama_dir, policy)
    try:
        for q in range(4):
            _complete(srv, SYSTEM["a"] + [q + 10])
        reason = policy.replace("-", "_")
        assert _decisions(srv)[reason] == 4
        grew = _queries(srv)
        if policy == "round-robin":  # alternates: the prefix is prefilled on both replicas
            assert all(g > 0 for g in grew), grew
    finally:
        srv.stop()
