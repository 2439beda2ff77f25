"""Disaggregated prefill and decode on real Ray, over HTTP: one prefill and one decode replica behind a gateway.
Greedy, seeded, JSON-schema, logprobs, n=2, best_of, beam-search and speculated requests equal the aggregated
engine's outputs; long prompts are handed off (their KV pulled into the decode replica's cache, as the handoff
metrics show), short ones are prefilled on the decode replica; killing either replica's actor, aborts, leases that
run out and corrupted blocks, while requests are in flight, end every stream token-exact or as asked; afterwards no
KV block is held on either pool."""
from __future__ import annotations

import concurrent.futures
import time

import httpx2
import pytest
import ray

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.runtime.replicas import ReplicaRole
from pagedserve.common.sampling_params import BeamSearchParams, StructuredOutputsParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.tests.server_thread import ServerThread, free_port
from pagedserve.tests.utils import random_prompts

MAX_LOCAL = 24  # a prompt with more uncached tokens than this is prefilled on the prefill replica
RECOVERY_S = 120  # every stream in flight ends this soon after a replica is killed (Ray restarts it meanwhile)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _serve(model_dir: str, **engine) -> ServerThread:
    return ServerThread(EngineArgs(model=model_dir, seed=0, max_model_len=256, block_size=8, **engine),
                        prefill_replicas=1, decode_replicas=1, max_local_prefill_length=MAX_LOCAL,
                        http_port=free_port()).start()


def _complete(srv: ServerThread, prompt: list[int], **body) -> list[list[int]]:
    r = httpx2.post(f"{srv.http_url}/v1/completions", timeout=120,
                    json={"prompt": prompt, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def _metric(srv: ServerThread, family: str) -> dict[tuple, float]:
    engine = srv.gateway.state.engine
    return {tuple(sorted(s.labels.items())): s.value for fam in engine.disagg.collect_metrics()
            for s in fam.samples if s.name == family}


def _all_blocks_free(srv: ServerThread) -> None:
    """Every block of both replicas free (cached ones count as free), no lease held: once a restarted one is back."""
    deadline = time.monotonic() + 60
    while True:
        try:
            stats = [ray.get(r.actor.get_stats.remote()) for r in srv.replicas]
        except ray.exceptions.RayError:
            stats = None
        if (stats and all(s.kv_blocks_free == s.kv_blocks_total for s in stats)) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert stats and all(s.kv_blocks_free == s.kv_blocks_total for s in stats), stats


def _placement_groups() -> set[str]:
    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] == "CREATED"}


def _reference(model_dir: str, prompts: list[list[int]], params: SamplingParams) -> list[list[list[int]]]:
    llm = LLM(model_dir, seed=0, max_model_len=256, block_size=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]


def _beams(model_dir: str, prompts: list[list[int]], params: BeamSearchParams) -> list[list[list[int]]]:
    llm = LLM(model_dir, seed=0, max_model_len=256, block_size=8)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    return [[s.tokens[len(p):] for s in o.sequences[:2]] for p, o in zip(prompts, outs)]


def test_handed_off_requests_equal_the_aggregated_engine(ray_cluster, llama_dir):
    long_prompts = random_prompts(4, seed=41, min_len=60, max_len=120)
    short = random_prompts(2, seed=42, min_len=5, max_len=12)
    # ignore_eos: no request ends at its first token, on its prefill replica (each long one is handed off)
    cases = [dict(temperature=0, max_tokens=12), dict(temperature=0.8, top_p=0.9, seed=7, max_tokens=12),
             # several completions and best_of: the decode replica runs them whole from the pulled prompt KV
             dict(temperature=0.8, seed=3, max_tokens=6, n=2), dict(temperature=0.8, seed=5, max_tokens=6, best_of=3)]
    cases = [dict(case, ignore_eos=True) for case in cases]
    expected = [_reference(llama_dir, long_prompts + short, SamplingParams(**body)) for body in cases]
    beam = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    expected_beams = _beams(llama_dir, long_prompts[:2], beam)
    logprobs = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    llm = LLM(llama_dir, seed=0, max_model_len=256, block_size=8)
    expected_logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                         for o in llm.generate([{"prompt_token_ids": p} for p in long_prompts[2:]], logprobs,
                                               use_tqdm=False)]
    del llm
    srv = _serve(llama_dir)
    try:
        roles = sorted(r.role for r in srv.replicas)
        assert roles == sorted([ReplicaRole.PREFILL, ReplicaRole.DECODE])
        assert _metric(srv, "pagedserve_pool_replicas") == {(("pool", "prefill"),): 1, (("pool", "decode"),): 1}
        salt = iter(range(1000))  # a new cache salt per long prompt and case: each is prefilled remotely once
        for body, want in zip(cases, expected):
            for prompt, tokens in zip(long_prompts + short, want):
                assert _complete(srv, prompt, cache_salt=f"s{next(salt)}", **body) == tokens
        for prompt, want in zip(long_prompts[:2], expected_beams):
            assert _complete(srv, prompt, n=2, best_of=3, temperature=0, max_tokens=6, use_beam_search=True,
                             ignore_eos=True, cache_salt=f"s{next(salt)}") == want
        for prompt, want in zip(long_prompts[2:], expected_logprobs):
            r = httpx2.post(f"{srv.http_url}/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2, "ignore_eos": True,
                "cache_salt": f"s{next(salt)}"})
            assert r.json()["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-4)
        decisions = _metric(srv, "pagedserve_disagg_decisions_total")
        remote = len(cases) * len(long_prompts) + len(long_prompts)
        assert decisions[(("decision", "remote"),)] == remote
        assert decisions[(("decision", "local"),)] == len(cases) * len(short)
        handoffs = _metric(srv, "pagedserve_handoffs_total")
        assert handoffs[(("outcome", "pulled"),)] == sum(handoffs.values()) == remote, handoffs
        assert not any(_metric(srv, "pagedserve_handoff_failures_total").values())
        assert _metric(srv, "pagedserve_kv_transfer_blocks_total")[()] >= remote * min(map(len, long_prompts)) // 8
        # Asked twice with no salt, a long prompt is handed off, then found on the decode replica: prefilled there.
        assert _complete(srv, long_prompts[0], **cases[0]) == expected[0][0]
        assert _complete(srv, long_prompts[0], **cases[0]) == expected[0][0]
        decisions = _metric(srv, "pagedserve_disagg_decisions_total")
        local = len(cases) * len(short) + 1
        assert decisions == {(("decision", "remote"),): remote + 1, (("decision", "local"),): local}
        _all_blocks_free(srv)
    finally:
        srv.stop()


def test_structured_output_and_speculative_decoding_across_the_handoff(ray_cluster, llama_dir):
    """Both pools run n-gram speculation: a JSON-schema request and greedy and seeded ones whose prompts repeat
    (drafts found) equal the aggregated engine's outputs."""
    prompt = random_prompts(1, seed=43, min_len=70, max_len=71)[0]
    repeats = [(p * 4)[:100] for p in random_prompts(2, seed=47, min_len=20, max_len=25)]
    constrained = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    want = _reference(llama_dir, [prompt], constrained)[0]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    seeded = SamplingParams(temperature=0.8, seed=9, max_tokens=24)
    want_greedy, want_seeded = _reference(llama_dir, repeats, greedy), _reference(llama_dir, repeats, seeded)
    srv = _serve(llama_dir, speculative_config=SPEC)
    try:
        got = _complete(srv, prompt, temperature=0, max_tokens=24, response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
        assert got == want
        for p, g, w in zip(repeats, want_greedy, want_seeded):
            assert _complete(srv, p, temperature=0, max_tokens=24) == g
            assert _complete(srv, p, temperature=0.8, seed=9, max_tokens=24, cache_salt="s") == w
        assert _metric(srv, "pagedserve_disagg_decisions_total")[(("decision", "remote"),)] == 1 + 2 * len(repeats)
        decode = next(r for r in srv.replicas if r.role == ReplicaRole.DECODE)
        assert ray.get(decode.actor.get_stats.remote()).scheduler.spec_num_drafts > 0
    finally:
        srv.stop()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("role, when", [(ReplicaRole.PREFILL, "first_send"), (ReplicaRole.PREFILL, "mid_pull"),
                                        (ReplicaRole.DECODE, "mid_pull")])
def test_killing_a_replica_leaves_every_stream_token_exact(ray_cluster, llama_dir, role, when):
    """32 streams in flight; the replica's actor is SIGKILLed in the phase asked: every stream ends token-exact
    within RECOVERY_S of the kill."""
    prompts = random_prompts(32, seed=44, min_len=60, max_len=150)
    body = dict(temperature=0.7, seed=11, max_tokens=16, ignore_eos=True)
    want = _reference(llama_dir, prompts, SamplingParams(temperature=0.7, seed=11, max_tokens=16, ignore_eos=True))
    before = _placement_groups()
    srv = _serve(llama_dir)
    actors = [r.actor for r in srv.replicas]
    try:
        victim = next(r for r in srv.replicas if r.role == role)
        prefill = next(r for r in srv.replicas if r.role == ReplicaRole.PREFILL)
        if when == "mid_pull":  # the first pull waits in the prefill replica's export until the kill
            ray.get(prefill.actor.inject_kv_export_faults.remote(stall=1))
        engine = srv.gateway.state.engine
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(_complete, srv, p, **body) for p in prompts]
            while not (engine.disagg.num_in_flight if when == "mid_pull" else engine.disagg.stats.remote):
                time.sleep(0.005)
            if when == "mid_pull":
                time.sleep(0.2)  # the pull reached the export
            ray.kill(victim.actor, no_restart=False)  # SIGKILL; Ray restarts it
            killed = time.monotonic()
            got = [f.result(timeout=300) for f in futures]
            recovered_s = time.monotonic() - killed
        assert got == want
        assert recovered_s < RECOVERY_S
        if when == "mid_pull":
            failures = _metric(srv, "pagedserve_handoff_failures_total")
            lost = "prefill_lost" if role == ReplicaRole.PREFILL else "decode_lost"
            assert failures[(("cause", lost),)] >= 1, failures
        _all_blocks_free(srv)
    finally:
        srv.stop()
    assert _placement_groups() == before  # both pools' groups released, the restarted one's too
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.pid.remote(), timeout=30)


def _stream_until(srv: ServerThread, prompt: list[int], tokens_before_abort: int) -> int:
    """Stream a completion and drop the connection after this many tokens (0: before the first); tokens seen."""
    seen = 0
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx2.stream("POST", f"{srv.http_url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if seen >= tokens_before_abort:
                break
            if line.startswith("data: {"):
                seen += 1
    return seen


def test_client_aborts_in_each_phase_free_every_block(ray_cluster, llama_dir):
    """Among 32 streams, clients that go away before their first token (prefill replica), at the first token (the
    handoff) and while they decode leave no block held on either pool, and no lease; the others end token-exact."""
    prompts = random_prompts(6, seed=45, min_len=80, max_len=120)
    others = random_prompts(26, seed=48, min_len=40, max_len=120)
    want = _reference(llama_dir, others, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    srv = _serve(llama_dir)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts) + len(others)) as pool:
            done = [pool.submit(_complete, srv, p, temperature=0, max_tokens=16, ignore_eos=True) for p in others]
            seen = list(pool.map(_stream_until, [srv] * len(prompts), prompts, [0, 1, 1, 3, 8, 20]))
            got = [f.result(timeout=RECOVERY_S) for f in done]
        assert seen == [0, 1, 1, 3, 8, 20]
        assert got == want
        assert _metric(srv, "pagedserve_disagg_decisions_total")[(("decision", "remote"),)] == \
            len(prompts) + sum(len(p) > MAX_LOCAL for p in others)
        _all_blocks_free(srv)
        assert not srv.gateway.state.engine.inflight
    finally:
        srv.stop()


def test_leases_run_out_and_corrupted_blocks_are_refused_and_recomputed(ray_cluster, llama_dir):
    """Under 32 concurrent streams, with a lease of 0.5 s, the prefill replica's next 8 exports are held 1.5 s (the
    leases run out meanwhile) and then carry a flipped byte in their second block: the decode replica keeps only the
    first block of each, computes the rest, and every output is exact."""
    prompts = random_prompts(32, seed=46, min_len=60, max_len=150)
    body = dict(temperature=0.7, seed=13, max_tokens=8)
    want = _reference(llama_dir, prompts, SamplingParams(temperature=0.7, seed=13, max_tokens=8))
    srv = _serve(llama_dir, kv_lease_timeout=0.5)
    try:
        prefill = next(r for r in srv.replicas if r.role == ReplicaRole.PREFILL)
        ray.get(prefill.actor.inject_kv_export_faults.remote(corrupt=8, stall=8, stall_s=1.5))
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: _complete(srv, p, **body), prompts))
        assert got == want
        failures = _metric(srv, "pagedserve_handoff_failures_total")
        assert failures[(("cause", "blocks_refused"),)] == 8, failures
        assert _metric(srv, "pagedserve_handoffs_total")[(("outcome", "partial"),)] == 8
        stats = ray.get(prefill.actor.get_stats.remote())
        assert stats.num_kv_leases_expired >= 8 and stats.num_kv_leases == 0
        _all_blocks_free(srv)
    finally:
        srv.stop()


def _scale(srv: ServerThread, n: int, pool: str | None) -> httpx2.Response:
    return httpx2.post(f"{srv.http_url}/scale_elastic_ep", timeout=300,
                       json={"new_data_parallel_size": n, **({"pool": pool} if pool else {})})


def test_each_pool_scales_on_its_own(ray_cluster, llama_dir):
    """The prefill pool scales to 0 (every request then runs whole on the decode pool) and back, the decode pool
    out and in, outputs exact throughout; a pool on an aggregated server is a 400."""
    prompts = random_prompts(3, seed=47, min_len=60, max_len=100)
    body = dict(temperature=0, max_tokens=6)
    want = _reference(llama_dir, prompts, SamplingParams(temperature=0, max_tokens=6))
    srv = _serve(llama_dir)
    try:
        def remote() -> float:
            return _metric(srv, "pagedserve_disagg_decisions_total")[(("decision", "remote"),)]

        assert _scale(srv, 0, "prefill").status_code == 200
        before = remote()
        assert [_complete(srv, p, **body) for p in prompts] == want
        assert remote() == before  # no prefill pool: prefilled on the decode replica
        r = _scale(srv, 1, "prefill")
        assert r.status_code == 200 and r.json()["added"] == 1
        assert _scale(srv, 2, None).json()["num_replicas"] == 3  # the decode pool by default
        assert sorted(x.role.value for x in srv.replicas) == ["decode", "decode", "prefill"]
        fresh = random_prompts(3, seed=48, min_len=60, max_len=100)
        assert [_complete(srv, p, **body) for p in fresh] == _reference(llama_dir, fresh, SamplingParams(
            temperature=0, max_tokens=6))
        assert remote() == before + len(fresh)
        assert _scale(srv, 0, "decode").status_code == 400  # the decode pool keeps one replica
        assert _scale(srv, 1, "decode").json()["removed"] == 1
    finally:
        srv.stop()


def test_tensor_parallel_replicas_hand_off_rank_to_rank(ray_cluster, llama_dir):
    """TP=2 on both pools: each rank's share of every block moves to the same rank on the decode replica."""
    prompts = random_prompts(3, seed=49, min_len=60, max_len=120)
    want = _reference(llama_dir, prompts, SamplingParams(temperature=0, max_tokens=8))
    srv = _serve(llama_dir, tensor_parallel_size=2)
    try:
        assert [_complete(srv, p, temperature=0, max_tokens=8) for p in prompts] == want
        handoffs = _metric(srv, "pagedserve_handoffs_total")
        assert handoffs[(("outcome", "pulled"),)] == len(prompts), handoffs
        # Both ranks' shares moved: the bytes are every layer's K and V of every pulled block, whole.
        itemsize = {"float32": 4, "bfloat16": 2}[srv.gateway.state.engine.info.dtype]
        per_block = 2 * 2 * 8 * 2 * 16 * itemsize  # K and V, 2 layers, block 8, 2 KV heads (one per rank) x 16
        blocks = _metric(srv, "pagedserve_kv_transfer_blocks_total")[()]
        assert _metric(srv, "pagedserve_kv_transfer_bytes_total")[()] == blocks * per_block
        _all_blocks_free(srv)
    finally:
        srv.stop()


def test_the_prefill_pool_autoscales_on_its_queued_prompt_tokens(ray_cluster, llama_dir):
    """A burst of long prompts queues prompt tokens on the one prefill replica (it runs two at a time): the prefill
    pool's autoscaler adds a second, the decode pool's (waiting requests, KV usage) keeps its one; once idle, the
    prefill pool goes back to one. Every output is exact."""
    policy = ("min=1,max=2,prefill_tokens=100,waiting=1000,kv_usage=0.99,ttft_p90=1000,interval=0.5,"
              "scale_out_cooldown=0,scale_in_cooldown=4")
    srv = ServerThread(EngineArgs(model=llama_dir, seed=0, max_model_len=256, block_size=8, max_num_seqs=2),
                       prefill_replicas=1, decode_replicas=1, max_local_prefill_length=MAX_LOCAL,
                       http_port=free_port(), autoscale=policy).start()

    def pools() -> list[str]:
        return sorted(r.role.value for r in srv.replicas if r.serving)

    try:
        prompts = random_prompts(16, seed=50, min_len=100, max_len=200)
        want = _reference(llama_dir, prompts, SamplingParams(temperature=0, max_tokens=4))
        deadline = time.monotonic() + 120
        while pools().count("prefill") < 2:
            assert time.monotonic() < deadline, "the prefill pool did not scale out"
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(lambda p: _complete(srv, p, temperature=0, max_tokens=4), prompts))
            assert got == want
        assert pools().count("decode") == 1
        deadline = time.monotonic() + 60
        while pools() != ["decode", "prefill"]:
            assert time.monotonic() < deadline, "the prefill pool did not scale back in"
            time.sleep(0.5)
    finally:
        srv.stop()
