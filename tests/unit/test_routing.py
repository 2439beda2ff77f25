"""Routing by prefix-cache state, on hand-built replica states and KV events (no Ray cluster, no model)."""
from __future__ import annotations

import asyncio

import pytest

from pagedserve.cluster.runtime.replicas import Replica
from pagedserve.cluster.runtime.router import ReplicaRouter
from pagedserve.cluster.runtime.routing import PrefixAware, RoundRobin, default_policy, make_policy
from pagedserve.common.config import RequestLimits
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.engine.core_types import EngineCoreRequest, EngineInfo
from pagedserve.scheduler.block_manager import BlockManager, prompt_block_hashes
from pagedserve.scheduler.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheSnapshot,
    KVEventBatch,
)
from pagedserve.scheduler.request import Sequence

BS = 16


def _info() -> EngineInfo:
    return EngineInfo(model="m", architecture="LlamaForCausalLM", dtype="float32", max_model_len=4096,
                      vocab_size=1000, eos_token_ids=(2,), tensor_parallel_size=1, block_size=BS, num_kv_blocks=100,
                      enable_prefix_caching=True, limits=RequestLimits(max_seqs=4, max_logprobs=5,
                                                                       max_prompt_bytes=100_000))


def _router(policy=None, n: int = 2) -> ReplicaRouter:
    return ReplicaRouter([Replica(i, None, None) for i in range(n)], None, [_info()] * n, policy)


def _request(ids: list[int], salt: str | None = None) -> EngineCoreRequest:
    return EngineCoreRequest("r", ids, SamplingParams(max_tokens=16), cache_salt=salt)


def _admit(router: ReplicaRouter, ids: list[int], session: str | None = None) -> tuple[int, str]:
    """Route a request and count it on its replica as ``generate`` does (it never finishes here)."""
    pick = router.picker.route(_request(ids), session)
    pick.replica.load += 1
    pick.replica.work += len(ids) - pick.num_cached_tokens + 16
    return pick.replica.index, pick.reason


def _deliver(router: ReplicaRouter, index: int, *items) -> None:
    asyncio.run(router.health.deliver(router.replicas[index], list(items)))


SYSTEM = list(range(100, 100 + 20 * BS))  # a tenant's 20-block system prompt


def _cache(router: ReplicaRouter, index: int, ids: list[int], salt: str | None = None) -> None:
    hashes = prompt_block_hashes(ids, BS, salt)
    _deliver(router, index, KVEventBatch([BlockStored(h, p) for h, p in zip(hashes, [None, *hashes])]))


def test_block_manager_events_chain_the_hashes_the_router_computes():
    bm = BlockManager(num_blocks=3, block_size=4, enable_caching=True)
    assert bm.take_kv_events() == []  # starts the recording
    ids = list(range(10, 19))
    seq = Sequence(seq_id=0, index=0, token_ids=ids, prompt_len=len(ids), seed=0)
    assert bm.allocate_slots(seq, len(ids))
    seq.num_computed_tokens = len(ids)
    bm.cache_full_blocks(seq, "salt")
    h = prompt_block_hashes(ids, 4, "salt")
    assert len(h) == 2 and prompt_block_hashes(ids, 4, None) != h
    assert bm.take_kv_events() == [BlockStored(h[0], None), BlockStored(h[1], h[0])]
    assert set(bm.cached_block_hashes()) == set(h)
    bm.free(seq)
    other = Sequence(seq_id=1, index=0, token_ids=[1] * 12, prompt_len=12, seed=0)
    assert bm.allocate_slots(other, 12)  # takes the free block, then evicts both cached ones (tail first)
    assert bm.take_kv_events() == [BlockRemoved(h[1]), BlockRemoved(h[0])]
    bm.free(other)
    bm.reset_prefix_cache()
    assert bm.take_kv_events() == []  # nothing was cached: nothing to clear


def test_no_events_are_kept_until_someone_drains_them():
    bm = BlockManager(num_blocks=3, block_size=4, enable_caching=True)
    seq = Sequence(seq_id=0, index=0, token_ids=list(range(8)), prompt_len=8, seed=0)
    bm.allocate_slots(seq, 8)
    seq.num_computed_tokens = 8
    bm.cache_full_blocks(seq, None)
    assert bm.pool.events is None


def test_prefix_aware_sends_a_prompt_to_the_replica_holding_its_prefix():
    router = _router(PrefixAware(balance_factor=1.0))
    _cache(router, 1, SYSTEM + [1])
    assert _admit(router, SYSTEM + [7, 8, 9]) == (1, "prefix_hit")
    # A salted request hashes differently: nothing matches.
    pick = router.picker.route(_request(SYSTEM + [7, 8, 9], salt="tenant-b"))
    assert pick.reason == "no_match"
    assert router.picker.decisions["prefix_hit"] == 1 and router.picker.decisions["no_match"] == 1


def test_the_balance_factor_spreads_a_hot_prefix_once_its_replica_is_loaded():
    spread = _router(PrefixAware(balance_factor=1.0))
    _cache(spread, 0, SYSTEM + [1])
    picks = [_admit(spread, SYSTEM + [i, i + 1]) for i in range(40)]
    assert picks[0] == (0, "prefix_hit")
    assert (1, "balance") in picks  # replica 0 got busy: the prefix moved on
    # Once replica 1 caches it too, both take the tenant.
    _cache(spread, 1, SYSTEM + [1])
    assert {_admit(spread, SYSTEM + [i])[0] for i in range(40)} == {0, 1}

    by_cache = _router(PrefixAware(balance_factor=0.0))  # by cache alone: a hot spot
    _cache(by_cache, 0, SYSTEM + [1])
    assert {_admit(by_cache, SYSTEM + [i, i + 1]) for i in range(40)} == {(0, "prefix_hit")}


def test_without_shared_prefixes_prefix_aware_balances_like_least_loaded():
    router = _router(PrefixAware(balance_factor=1.0))
    picks = [_admit(router, [i] * 100)[0] for i in range(1, 11)]
    assert picks.count(0) == picks.count(1) == 5


def test_events_and_snapshots_keep_the_router_in_sync():
    router = _router(PrefixAware())
    h = prompt_block_hashes(SYSTEM + [1], BS, None)
    _cache(router, 0, SYSTEM + [1])
    assert router.replicas[0].cached == set(h)
    _deliver(router, 0, KVEventBatch([BlockRemoved(h[-1])]))
    assert router.picker.route(_request(SYSTEM + [1])).num_cached_tokens == (len(h) - 1) * BS
    _deliver(router, 0, KVEventBatch([AllBlocksCleared()]))
    assert router.replicas[0].cached == set()
    # A router that connects late (or reconnects) learns the whole cache from the snapshot, which replaces it.
    router.replicas[1].cached = {b"stale"}
    _deliver(router, 1, KVCacheSnapshot(h[:5]))
    assert router.replicas[1].cached == set(h[:5])
    assert router.picker.route(_request(SYSTEM + [1])).replica.index == 1


def test_a_session_sticks_to_its_replica_and_falls_back_when_it_cannot_serve():
    router = _router(make_policy("least-loaded"))
    assert _admit(router, [5] * 40, "alice") == (0, "least_loaded")
    # The least-loaded replica is now 1, but alice stays on 0.
    assert _admit(router, [6] * 40, "alice") == (0, "affinity")
    assert _admit(router, [6] * 40, "bob")[0] == 1
    router.replicas[0].alive = False  # its actor died: the session moves at once and sticks to the new replica
    assert _admit(router, [7] * 40, "alice") == (1, "affinity_fallback")
    router.replicas[0].alive = True
    assert _admit(router, [7] * 40, "alice") == (1, "affinity")
    router.replicas[1].load = 50  # overloaded against replica 0
    assert _admit(router, [8] * 40, "alice") == (0, "affinity_fallback")
    assert router.picker.decisions["affinity"] == 2 and router.picker.decisions["affinity_fallback"] == 2


def test_policies_and_defaults():
    rr = _router(RoundRobin())
    assert [_admit(rr, [1, 2])[0] for _ in range(4)] == [0, 1, 0, 1]
    rr.replicas[1].ready = False
    assert [_admit(rr, [1, 2])[0] for _ in range(2)] == [0, 0]
    assert default_policy(1) == "least-loaded" and default_policy(2) == "prefix-aware"
    with pytest.raises(ValueError):
        make_policy("random")
    with pytest.raises(ValueError):
        PrefixAware(-1.0)


def test_routing_decisions_are_exported_by_policy_and_reason():
    router = _router(PrefixAware())
    _admit(router, [1] * 40)
    fam = next(f for f in router.collect_metrics() if f.name == "pagedserve_routing_decisions")
    values = {s.labels["reason"]: s.value for s in fam.samples}
    assert values == {"prefix_hit": 0, "balance": 0, "no_match": 1, "affinity": 0, "affinity_fallback": 0}
    assert {s.labels["policy"] for s in fam.samples} == {"prefix-aware"}


def test_a_burst_of_one_tenant_follows_its_first_request_before_any_event():
    router = _router(PrefixAware(balance_factor=0.0))
    assert {_admit(router, SYSTEM + [i]) for i in range(6)} == {(0, "no_match"), (0, "prefix_hit")}
    # An eviction the replica reports still takes the block out again.
    h = prompt_block_hashes(SYSTEM, BS, None)
    _deliver(router, 0, KVEventBatch([BlockRemoved(h[0])]))
    assert router.picker.route(_request(SYSTEM + [1])).num_cached_tokens == 0
