"""Elastic replicas under load: scaling 2 -> 3 -> 1 -> 2 while 100+ streams run (the HTTP admin route and `pagedserve
scale`), the autoscaler on a burst and when idle, a scale-in cut short by the server stopping, and a rollout to new
weights. Every stream completes, greedy and seeded ones with exactly the tokens of an offline run (a scale-in moves
requests mid-stream), the served replica count follows, and no placement group is left behind."""
from __future__ import annotations

import asyncio
import shutil
import sys

import httpx2
import pytest
import ray._private.state as ray_state

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.client import AsyncClient
from pagedserve.cluster.runtime.replica_set import ReplicaSet
from pagedserve.cluster.runtime.replicas import launch_replicas
from pagedserve.cluster.runtime.router import ReplicaRouter
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.tokenizer import load_tokenizer
from pagedserve.tests.server_thread import ServerThread, free_port
from pagedserve.tests.utils import make_model, random_prompts

MAX_TOKENS = 40
CONCURRENCY = 104
PROMPTS = random_prompts(6, seed=11, min_len=4, max_len=24)


def _params(i: int) -> SamplingParams:
    """Stream i: greedy, or (every fourth) sampled with a seed of its own."""
    if i % 4 == 3:
        return SamplingParams(temperature=0.8, seed=i % 5, max_tokens=MAX_TOKENS, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _key(i: int) -> tuple[int, int | None]:
    return i % len(PROMPTS), _params(i).seed


@pytest.fixture(scope="module")
def model_dir(model_factory) -> str:
    return model_factory("gpt2")


@pytest.fixture(scope="module")
def expected(model_dir) -> dict[tuple[int, int | None], list[int]]:
    llm = LLM(model_dir, seed=0)
    keys = sorted({_key(i) for i in range(60)}, key=str)
    firsts = [next(i for i in range(60) if _key(i) == k) for k in keys]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[k[0]]} for k in keys], [_params(i) for i in firsts],
                        use_tqdm=False)
    return {k: o.outputs[0].token_ids for k, o in zip(keys, outs)}


def _gauge(metrics_text: str, name: str) -> float:
    """The value of a gauge with one series (whatever its labels)."""
    (value,) = [float(ln.rsplit(" ", 1)[1]) for ln in metrics_text.splitlines()
                if ln.startswith((name + " ", name + "{"))]
    return value


def _created_pgs(ray_cluster) -> set[str]:
    """Placement groups placed now (ids: other tests' may go away meanwhile, so compare sets, not counts)."""
    return {pg_id for pg_id, pg in ray_cluster.util.placement_group_table().items() if pg["state"] == "CREATED"}


def _live_engines() -> set[str]:
    """Engine-core actors not dead (alive, restarting or being created), from the GCS's actor table."""
    return {actor_id for actor_id, a in ray_state.actors().items()
            if "EngineCoreActor" in a.get("ActorClassName", "") and a.get("State") != "DEAD"}


def test_scale_out_and_in_under_load(ray_cluster, model_dir, expected):
    pgs_before, engines_before = _created_pgs(ray_cluster), _live_engines()
    srv = ServerThread(EngineArgs(model=model_dir, seed=0), data_parallel_size=2, http_port=free_port(),
                       drain_timeout=30.0).start()
    try:
        results, steps = asyncio.run(_scale_under_load(srv))
        # Every stream ran to its end, with the tokens an offline run gives (greedy and seeded alike).
        assert len(results) >= 2 * CONCURRENCY
        wrong = [(i, toks) for i, toks, finish in results if finish != "length" or toks != expected[_key(i)]]
        assert not wrong, f"{len(wrong)} of {len(results)} streams differ, e.g. {wrong[0]}"
        out, scale_in, back = steps
        assert (out["added"], out["num_replicas"]) == (1, 3)
        assert (scale_in["removed"], scale_in["num_replicas"]) == (2, 1)
        assert scale_in["moved_requests"] > 0  # drain_timeout 0: streams moved mid-way, and still came out exact
        assert back["num_replicas"] == 2
        assert len(_live_engines() - engines_before) == 2  # the removed replicas' actors are gone, not only unrouted
    finally:
        srv.stop()
    assert _created_pgs(ray_cluster) <= pgs_before  # each removed replica's placement group was released
    assert _live_engines() <= engines_before


def test_a_scale_in_cancelled_mid_drain_still_releases_its_replica(ray_cluster, model_dir):
    """A server that stops cancels its autoscaler, which may be mid scale-in: the replica the scale-in had taken out
    of the set is released all the same, its placement group with it."""
    pgs_before, engines_before = _created_pgs(ray_cluster), _live_engines()
    args = EngineArgs(model=model_dir, seed=0)
    replicas = launch_replicas(args, 2)

    async def cancel_mid_drain() -> ReplicaSet:
        infos = await asyncio.gather(*[r.actor.get_info.remote() for r in replicas])
        router = ReplicaRouter(replicas, load_tokenizer(model_dir), infos)
        replica_set = ReplicaSet(args, replicas, router, drain_timeout=30.0)
        scale_in = asyncio.create_task(replica_set.scale_to(1))
        while len(replica_set.replicas) == 2:  # until the victim is out of the set, at its drain's first await
            await asyncio.sleep(0)
        scale_in.cancel()
        await asyncio.gather(scale_in, return_exceptions=True)
        return replica_set

    replica_set = asyncio.run(cancel_mid_drain())
    try:
        assert len(replica_set.replicas) == 1
        assert len(_live_engines() - engines_before) == 1  # the victim's actor is gone, not only unrouted
    finally:
        asyncio.run(replica_set.shutdown())
    assert _created_pgs(ray_cluster) <= pgs_before
    assert _live_engines() <= engines_before


async def _scale_under_load(srv: ServerThread) -> tuple[list[tuple[int, list[int], str]], list[dict]]:
    results: list[tuple[int, list[int], str]] = []
    stop = asyncio.Event()
    async with AsyncClient(srv.target) as client, httpx2.AsyncClient(base_url=srv.http_url, timeout=300) as http:
        async def one(i: int) -> None:
            p = _params(i)
            tokens, finish = [], None
            async for d in client.generate_stream(PROMPTS[i % len(PROMPTS)], max_tokens=MAX_TOKENS,
                                                  temperature=p.temperature, seed=p.seed, ignore_eos=True):
                tokens += d.token_ids
                finish = d.finish_reason or finish
            results.append((i, tokens, finish))

        async def load() -> None:
            """Keep CONCURRENCY streams in flight until told to stop; a failed stream fails the test."""
            running: set[asyncio.Task] = set()
            i = 0
            while not stop.is_set() or running:
                while not stop.is_set() and len(running) < CONCURRENCY:
                    running.add(asyncio.create_task(one(i)))
                    i += 1
                done, running = await asyncio.wait(running, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()

        async def until(count: int, timeout: float = 240.0) -> None:
            """Until ``count`` streams have ended; a failed stream (the loader's error) or a stall fails the test."""
            deadline = asyncio.get_running_loop().time() + timeout
            while len(results) < count:
                if loader.done():
                    loader.result()
                    raise AssertionError("the load stopped early")
                assert asyncio.get_running_loop().time() < deadline, f"{len(results)} of {count} streams ended"
                await asyncio.sleep(0.05)

        async def scale(n: int, **body) -> dict:
            await until(8)  # streams are flowing (and some are mid-way) when the change starts
            change = asyncio.ensure_future(http.post("/scale_elastic_ep", json={"new_data_parallel_size": n, **body}))
            while not change.done():  # vLLM's status route, by GET and by POST
                method = http.get if len(scaling) % 2 else http.post
                scaling.append((await method("/is_scaling_elastic_ep")).json()["is_scaling_elastic_ep"])
                await asyncio.sleep(0.05)
            r = await change
            assert r.status_code == 200, r.text
            assert (await client.model_info()).data_parallel_size == n
            assert (await http.get("/is_scaling_elastic_ep")).json() == {"is_scaling_elastic_ep": False}
            return r.json()

        loader = asyncio.create_task(load())
        scaling: list[bool] = []
        steps = [await scale(3)]
        assert any(scaling), scaling  # starting two replicas takes seconds: the route saw it
        steps.append(await scale(1, drain_timeout=0))
        # The command line: the same route.
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pagedserve", "scale", "--server", srv.http_url.removeprefix("http://"),
            "--replicas", "2", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await proc.communicate()
        assert proc.returncode == 0, stderr.decode()
        assert stdout.decode().strip() == "scaled to 2 replicas"
        assert (await client.model_info()).data_parallel_size == 2
        steps.append({"num_replicas": 2})
        bad = [await http.post("/scale_elastic_ep", json=body) for body in
               ({"new_data_parallel_size": 0}, {"new_data_parallel_size": "two"}, {},
                {"new_data_parallel_size": 2, "pool": "prefill"})]  # pools: only a disaggregated server's
        assert [r.status_code for r in bad] == [400, 400, 400, 400], [r.text for r in bad]
        await until(len(results) + CONCURRENCY)  # a full round more on the new replica set
        stop.set()
        await loader
        for _ in range(30):  # /metrics serves a snapshot of the engines' series at most a second old
            if _gauge((await http.get("/metrics")).text, "pagedserve_serving_replicas") == 2.0:
                break
            await asyncio.sleep(0.2)
        assert _gauge((await http.get("/metrics")).text, "pagedserve_serving_replicas") == 2.0
        info = await client.model_info()
        assert info.num_running_requests == 0 and info.num_free_kv_blocks == info.num_kv_blocks * 2  # none leaked
    return results, steps


def test_autoscaler_scales_out_under_a_burst_and_back_in_when_idle(ray_cluster, model_dir):
    """Short cooldowns: a queue of waiting requests asks for a second replica; once idle for the scale-in window,
    the second goes again. The decision is exported either way (pagedserve_desired_replicas)."""
    pgs_before = _created_pgs(ray_cluster)
    policy = "min=1,max=2,waiting=1,interval=0.5,scale_out_cooldown=0,scale_in_cooldown=4"
    srv = ServerThread(EngineArgs(model=model_dir, seed=0, max_num_seqs=2), http_port=free_port(),
                       autoscale=policy).start()
    try:
        asyncio.run(_burst_then_idle(srv))
    finally:
        srv.stop()
    assert _created_pgs(ray_cluster) <= pgs_before


async def _burst_then_idle(srv: ServerThread) -> None:
    async with AsyncClient(srv.target) as client, httpx2.AsyncClient(base_url=srv.http_url, timeout=60) as http:
        async def desired() -> float:
            return _gauge((await http.get("/metrics")).text, "pagedserve_desired_replicas")

        async def one(i: int) -> int:
            n = 0
            async for d in client.generate_stream(PROMPTS[i % len(PROMPTS)], max_tokens=MAX_TOKENS,
                                                  temperature=0.0, ignore_eos=True):
                n += len(d.token_ids)
            return n

        assert (await client.model_info()).data_parallel_size == 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 180
        counts: list[int] = []
        while (await client.model_info()).data_parallel_size < 2:  # bursts of 16 on a replica running 2 at once
            assert loop.time() < deadline, "no scale-out under the burst"
            counts += await asyncio.gather(*[one(i) for i in range(16)])
        assert all(n == MAX_TOKENS for n in counts)
        seen_two = await desired()
        assert seen_two == 2.0
        deadline = loop.time() + 60
        while (await client.model_info()).data_parallel_size > 1:  # idle now
            assert loop.time() < deadline, "no scale-in when idle"
            await asyncio.sleep(0.5)
        for _ in range(20):  # the metric follows within an interval (and the /metrics snapshot's second)
            if await desired() == 1.0:
                break
            await asyncio.sleep(0.3)
        assert await desired() == 1.0


@pytest.fixture(scope="module")
def rollout_server(ray_cluster, model_dir):
    """Two replicas of ``model_dir`` for the rollout tests, in this order: the rollout that fails (it must leave the
    replicas as they were, which its test checks), then the one to new weights. When the module ends the server
    stops and releases every placement group it held."""
    pgs_before = _created_pgs(ray_cluster)
    srv = ServerThread(EngineArgs(model=model_dir, seed=0), data_parallel_size=2, http_port=free_port()).start()
    try:
        yield srv
    finally:
        srv.stop()
    assert _created_pgs(ray_cluster) <= pgs_before


def test_a_rollout_whose_replica_cannot_start_leaves_the_old_ones_serving(rollout_server, ray_cluster, model_dir,
                                                                         tmp_path):
    """New weights that do not load (a truncated safetensors file): the rollout stops with a 503 naming the error,
    both old replicas still serve the old weights, and nothing of the failed replica is left."""
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = LLM(model_dir, seed=0).generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0]
    srv = rollout_server
    pgs_serving = _created_pgs(ray_cluster)
    with httpx2.Client(base_url=srv.http_url, timeout=300) as http:
        r = http.post("/rollout", json={"model": str(broken)})
        assert r.status_code == 503, r.text
        assert "still serve" in r.json()["error"]["message"]
    with srv.client() as c:
        assert c.model_info().data_parallel_size == 2
        for _ in range(4):  # both replicas, by least-loaded or prefix routing alike
            out = c.generate(PROMPTS[0], max_tokens=8, temperature=0.0, ignore_eos=True)
            assert list(out.completions[0].token_ids) == want.outputs[0].token_ids
    assert _created_pgs(ray_cluster) <= pgs_serving  # the failed replica's placement group was released


def test_rollout_to_new_weights_under_load(rollout_server, model_dir, tokenizer_dir, tmp_path):
    """Two replicas rolled over to a model dir of the same architecture with other weights while streams run: no
    stream fails, each has exactly the greedy tokens of one of the two models (a replaced replica's requests finish
    within its drain), every request after the rollout answers from the new weights, and the name stays."""
    new_dir = make_model(str(tmp_path / "v2"), "gpt2", seed=1, tokenizer_dir=tokenizer_dir)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    before, after = ([o.outputs[0].token_ids for o in LLM(d, seed=0).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)] for d in (model_dir, new_dir))
    assert before != after
    asyncio.run(_rollout_under_load(rollout_server, new_dir, before, after))


async def _rollout_under_load(srv: ServerThread, new_dir: str, before: list[list[int]],
                              after: list[list[int]]) -> None:
    async with AsyncClient(srv.target) as client, httpx2.AsyncClient(base_url=srv.http_url, timeout=600) as http:
        async def one(i: int) -> tuple[int, list[int]]:
            tokens = []
            async for d in client.generate_stream(PROMPTS[i % len(PROMPTS)], max_tokens=MAX_TOKENS,
                                                  temperature=0.0, ignore_eos=True):
                tokens += d.token_ids
            return i % len(PROMPTS), tokens

        name = (await client.model_info()).model_name
        bad = await http.post("/rollout", json={"model": str(new_dir) + "-missing"})
        assert bad.status_code == 400 and "model" in bad.json()["error"]["message"], bad.text
        stop = asyncio.Event()
        results: list[tuple[int, list[int]]] = []

        async def load() -> None:
            while not stop.is_set():
                results.extend(await asyncio.gather(*[one(i) for i in range(24)]))

        loader = asyncio.create_task(load())
        r = await http.post("/rollout", json={"model": new_dir})
        assert r.status_code == 200, r.text
        assert r.json()["num_replicas"] == 2 and r.json()["model"] == new_dir
        stop.set()
        await loader
        assert results and all(toks in (before[p], after[p]) for p, toks in results)
        info = await client.model_info()
        assert info.model_name == name and info.data_parallel_size == 2
        now = await asyncio.gather(*[one(i) for i in range(len(PROMPTS))])
        assert [toks for _, toks in now] == after
