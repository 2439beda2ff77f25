"""A replica takes a gateway that stops renewing its lease for dead (a SIGKILLed gateway ends no Ray generator): its
stream ends and its requests are aborted, their KV blocks freed, while a gateway that renews keeps its stream and
its request runs to the end. (test_gateways.py kills a real gateway process; this one shortens the lease.) Once
draining, the replica refuses a new request by type, which a gateway that routed it there before hearing of the drain
sends to another replica."""
from __future__ import annotations

import contextlib
import threading
import time

import pytest
import ray

from pagedserve.cluster.runtime.engine_core_actor import EngineCoreActor
from pagedserve.common.errors import ReplicaDrainingError
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.core_types import EngineCoreRequest

LEASE_S = 2.0
MAX_TOKENS = 3000  # far longer than the lease at any speed this model runs


def _drain(gen, got: dict) -> None:
    with contextlib.suppress(ray.exceptions.RayActorError):  # the test kills the replica at the end
        for ref in gen:
            for item in ray.get(ref):
                if getattr(item, "request_id", None) is not None:
                    got["tokens"] = got.get("tokens", 0) + sum(len(t) for t in item.new_token_ids.values())
                    got["finished"] = item.finished
        got["ended"] = time.monotonic()


def test_a_gateway_that_stops_renewing_loses_its_requests_and_only_it(ray_cluster, model_factory):
    model_dir = model_factory("llama", max_position_embeddings=4096)
    actor = ray.remote(EngineCoreActor).options(num_cpus=1).remote(
        EngineArgs(model=model_dir, seed=0, max_model_len=4096), gateway_lease_s=LEASE_S)
    try:
        ray.get(actor.warmup.remote(), timeout=120)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        got = {"silent": {}, "renewing": {}}
        threads = []
        subscribed = time.monotonic()  # before either lease starts
        for client in got:
            gen = actor.output_stream.options(num_returns="streaming").remote(client)
            ray.get(actor.add_request.remote(client, EngineCoreRequest(client, [5, 6, 7], params)))
            threads.append(threading.Thread(target=_drain, args=(gen, got[client]), daemon=True))
            threads[-1].start()
        start = time.monotonic()
        while threads[0].is_alive():  # only "renewing" renews
            ray.get(actor.renew_lease.remote("renewing"))
            time.sleep(LEASE_S / 5)
            assert time.monotonic() - start < 60, "the silent gateway's stream did not end"
        silent = got["silent"]
        assert silent["ended"] - subscribed >= LEASE_S and silent["ended"] - start < LEASE_S + 5
        assert not silent.get("finished") and silent.get("tokens", 0) < MAX_TOKENS
        assert threads[1].is_alive() and not got["renewing"].get("finished")  # the renewing one still streams
        while not got["renewing"].get("finished"):
            ray.get(actor.renew_lease.remote("renewing"))
            time.sleep(LEASE_S / 5)
            assert time.monotonic() - start < 300
        assert got["renewing"]["tokens"] == MAX_TOKENS and threads[1].is_alive()  # a gateway's stream outlives requests
        ray.get(actor.begin_drain.remote("scaled in"))
        with pytest.raises(ReplicaDrainingError, match="draining: scaled in"):
            ray.get(actor.add_request.remote("renewing", EngineCoreRequest("late", [5, 6, 7], params)))
        assert ray.get(actor.num_owned_requests.remote()) == 0
        stats = ray.get(actor.get_stats.remote())
        assert stats.num_running == 0 and stats.kv_blocks_free == stats.kv_blocks_total
        orphaned = next(f for f in ray.get(actor.get_metrics.remote()) if f.name == "pagedserve_orphaned_requests")
        assert orphaned.samples[0].value == 1
    finally:
        ray.kill(actor)
