"""Disaggregated prefill and decode (``serve --prefill-replicas P --decode-replicas D``).

A new request's decode replica is picked first, by the prefix blocks it holds (the router's policy over the decode
pool). If more than ``max_local_prefill_length`` of its prompt tokens are uncached there (Dynamo's conditional
disaggregation), a prefill replica, picked prefix-aware over the prefill pool, runs it with ``do_remote_decode``:
the prompt's KV and the first token, which streams to the client at once, its blocks held under a lease. Then the
decode replica pulls the blocks it lacks straight from the prefill replica's actor (every TP rank's share, each
block checked against its digest) into its prefix cache, the prefill replica lets them go, and the request resumes
on the decode replica from the tokens streamed so far, with its seed: the resume finds the pulled blocks cached. A
request that :func:`runs_whole` (several completions, best_of, beam search) is prefilled as one greedy sample, dropped,
then runs whole on the decode replica from the pulled KV.

The pull only warms a cache, so no failure in it can lose or change a token: a prefill replica lost before the
first token resumes the request on the decode pool (which prefills it), one lost during the pull, a pull past its
timeout, a lease that ran out or a block that fails its digest leave blocks out, which the decode replica computes;
a decode replica lost during the pull or later resumes the request on another. A client abort at any point ends it
on whichever replica holds it, and the lease is released whatever happened.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field

import ray
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from pagedserve.cluster.runtime.replica_health import unwrap
from pagedserve.cluster.runtime.replicas import Replica, ReplicaRole
from pagedserve.cluster.runtime.resumption import InFlight, Resumption
from pagedserve.cluster.runtime.routing import Pick, PrefixAware, ReplicaPicker
from pagedserve.common.errors import EngineUnavailableError
from pagedserve.common.outputs import EngineCoreOutput
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.engine.core_types import EngineCoreRequest
from pagedserve.engine.kv_transfer import KVImport
from pagedserve.scheduler.block_manager import prompt_block_hashes

logger = logging.getLogger(__name__)

DEFAULT_MAX_LOCAL_PREFILL_LENGTH = 512
DEFAULT_PULL_TIMEOUT_S = 30.0
REMOTE_DECODE = "remote_decode"  # the prefill engine's finish reason for a request it hands off
TRANSFER_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# How a handoff ended (pagedserve_handoffs_total's ``outcome``): every block pulled; some (or none) pulled and the
# rest recomputed on the decode replica; or the request ended meanwhile.
OUTCOMES = ("pulled", "partial", "recomputed", "aborted")
# Why blocks were not pulled (pagedserve_handoff_failures_total's ``cause``).
CAUSES = ("blocks_missing", "blocks_refused", "prefill_lost", "decode_lost", "timeout", "error")


@dataclass(frozen=True)
class DisaggConfig:
    """``max_local_prefill_length``: a request whose prompt has at most this many tokens uncached on its decode
    replica is prefilled there (Dynamo's knob); ``pull_timeout_s``: a pull that takes longer is given up (the decode
    replica computes the blocks)."""

    max_local_prefill_length: int = DEFAULT_MAX_LOCAL_PREFILL_LENGTH
    pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S


@dataclass
class HandoffStats:
    remote: int = 0  # requests prefilled on the prefill pool
    local: int = 0  # prefilled on their decode replica (short, or cached there)
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    blocks: int = 0
    bytes: int = 0
    seconds: list[int] = field(default_factory=lambda: [0] * (len(TRANSFER_BUCKETS_S) + 1))
    seconds_sum: float = 0.0

    def record(self, outcome: str, cause: str | None) -> None:
        self.outcomes[outcome] += 1
        if cause is not None:
            self.failures[cause] += 1

    def observe(self, result: KVImport, seconds: float) -> None:
        self.blocks += result.num_inserted
        self.bytes += result.num_bytes
        self.seconds[sum(seconds > b for b in TRANSFER_BUCKETS_S)] += 1
        self.seconds_sum += seconds


class Disaggregation:
    """The router's prefill pool and its handoffs. ``decode_picker``: the router's picker (the decode pool)."""

    def __init__(self, config: DisaggConfig, replicas: list[Replica], block_size: int, decode_picker: ReplicaPicker,
                 resumption: Resumption, inflight: dict[str, InFlight]) -> None:
        self.config = config
        self.block_size = block_size
        self.prefill_picker = ReplicaPicker(replicas, PrefixAware(), block_size, frozenset({ReplicaRole.PREFILL}))
        self.decode_picker = decode_picker
        self.resumption = resumption
        self.inflight = inflight
        self.stats = HandoffStats()
        self._tasks: set[asyncio.Task] = set()

    @property
    def num_in_flight(self) -> int:
        """Handoffs pulling now."""
        return len(self._tasks)

    @property
    def enabled(self) -> bool:
        """Whether the router has a prefill pool (replicas of role PREFILL, serving or not)."""
        return bool(self.prefill_picker.pool())

    def plan(self, request: EngineCoreRequest, decode: Pick[Replica]) -> Replica | None:
        """The prefill replica for a new request, or None: prefilled on its decode replica (short or mostly cached
        there, or no prefill replica serving)."""
        uncached = len(request.prompt_token_ids) - decode.num_cached_tokens
        if uncached <= self.config.max_local_prefill_length or \
                (runs_whole(request) and request.sampling_params.prompt_logprobs is not None):
            self.stats.local += 1
            return None
        try:
            prefill = self.prefill_picker.route(request).replica
        except EngineUnavailableError:
            self.stats.local += 1
            return None
        self.stats.remote += 1
        return prefill

    def intercept(self, rec: InFlight, replica: Replica, item: EngineCoreOutput) -> EngineCoreOutput | None:
        """An output of a request on its prefill replica that ends a sequence: passed on as it is unless it ends
        the prefill, which is passed on as the first token alone (or dropped, for a request the decode replica runs
        whole) while the handoff starts."""
        whole = runs_whole(rec.decode_request)
        # A whole request's prefill may also end at the context's length (its prompt one token short of it).
        ends_prefill = (REMOTE_DECODE, "length") if whole else (REMOTE_DECODE,)
        if item.error is not None or not any(reason in ends_prefill for reason, _ in item.finish_reasons.values()):
            return item
        if rec.resuming:  # its replica was lost meanwhile: the resume under way goes on from this token too
            if replica.alive:
                replica.actor.release_kv.remote(rec.request.request_id)
        else:
            # From here until the decode replica has it, a replica lost is the handoff's to deal with, not a resume's.
            rec.resuming = True
            first = [] if whole else item.new_token_ids.get(0, [])
            task = asyncio.get_running_loop().create_task(self.hand_off(rec, replica, first))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return None if whole else dataclasses.replace(item, finish_reasons={}, finished=False)

    async def hand_off(self, rec: InFlight, prefill: Replica, first: list[int]) -> None:
        """Pull the prompt's KV from ``prefill`` into the decode replica, then resume the request there (``rec``
        is marked resuming by ``intercept``)."""
        request = rec.request
        rid = request.request_id
        target = rec.decode_target if rec.decode_target is not None and rec.decode_target.serving else None
        outcome, cause = "recomputed", "error"  # until the pull says otherwise
        try:
            if target is None:
                target = self.decode_picker.pick()
            hashes = prompt_block_hashes(request.prompt_token_ids + first, self.block_size, request.cache_salt)
            loop = asyncio.get_running_loop()
            started = loop.time()
            result: KVImport = await asyncio.wait_for(
                target.actor.pull_kv.remote(prefill.actor, hashes), self.config.pull_timeout_s)
            self.stats.observe(result, loop.time() - started)
            outcome, cause = _judge(result, len(hashes))
        except asyncio.TimeoutError:
            cause = "timeout"
        except ray.exceptions.RayTaskError as e:  # raised in the decode replica's pull (first: it may also be
            # an instance of its cause's class, a RayActorError when the prefill replica died)
            lost = isinstance(unwrap(e), (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))
            cause = "prefill_lost" if lost else "error"
            if not lost:
                logger.warning("KV handoff of request %s failed: %s", rid, unwrap(e))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, EngineUnavailableError):
            cause = "decode_lost"  # the pull's own actor, or no decode replica serving
        except Exception:  # whatever went wrong, the request goes on: its decode replica computes the blocks
            logger.exception("KV handoff of request %s failed", rid)
        finally:
            rec.resuming = False
            if prefill.alive:
                prefill.actor.release_kv.remote(rid)
        if self.inflight.get(rid) is not rec:
            self.stats.record("aborted", cause)
            return
        self.stats.record(outcome, cause)
        if cause is not None:
            logger.info("KV handoff of request %s: %s (%s); the decode replica computes the rest", rid, outcome, cause)
        rec.leave_prefill()
        await self.resumption.continue_on(rec, target)

    def collect_metrics(self) -> list[Metric]:
        s = self.stats
        decisions = CounterMetricFamily("pagedserve_disagg_decisions", "New requests by where their prompt was "
                                        "prefilled: remote (the prefill pool) or local (their decode replica).",
                                        labels=["decision"])
        decisions.add_metric(["remote"], s.remote)
        decisions.add_metric(["local"], s.local)
        handoffs = CounterMetricFamily("pagedserve_handoffs", "KV handoffs from a prefill to a decode replica, by "
                                       "outcome: every block pulled, some, none (the decode replica computed the "
                                       "rest), or the request ended meanwhile.", labels=["outcome"])
        for outcome, n in s.outcomes.items():
            handoffs.add_metric([outcome], n)
        failures = CounterMetricFamily("pagedserve_handoff_failures", "KV handoffs that left blocks to compute, by "
                                       "cause.", labels=["cause"])
        for cause, n in s.failures.items():
            failures.add_metric([cause], n)
        blocks = CounterMetricFamily("pagedserve_kv_transfer_blocks", "KV blocks pulled into decode replicas.")
        blocks.add_metric([], s.blocks)
        moved = CounterMetricFamily("pagedserve_kv_transfer_bytes", "KV bytes pulled into decode replicas.")
        moved.add_metric([], s.bytes)
        seconds = HistogramMetricFamily("pagedserve_kv_transfer_seconds", "Time of each KV pull.")
        cumulative, buckets = 0, []
        for bound, n in zip((*map(str, TRANSFER_BUCKETS_S), "+Inf"), s.seconds):
            cumulative += n
            buckets.append((bound, cumulative))
        seconds.add_metric([], buckets, s.seconds_sum)
        requests = GaugeMetricFamily("pagedserve_pool_requests", "Requests this gateway runs on each pool: prefill "
                                     "(until their handoff), decode (every replica that decodes: all of them without "
                                     "a prefill pool).", labels=["pool"])
        replicas = GaugeMetricFamily("pagedserve_pool_replicas", "Replicas serving in each pool.", labels=["pool"])
        for pool, picker in (("prefill", self.prefill_picker), ("decode", self.decode_picker)):
            members = picker.pool()
            requests.add_metric([pool], sum(r.load for r in members))
            replicas.add_metric([pool], sum(r.serving for r in members))
        return [decisions, handoffs, failures, blocks, moved, seconds, requests, replicas]


def runs_whole(request: EngineCoreRequest) -> bool:
    """Several completions, best_of or a beam search: the decode replica runs the request whole, from the prompt's
    KV alone (the prefill replica runs one greedy sample of the prompt, dropped)."""
    return request.beam_params is not None or request.sampling_params.best_of > 1


def prefill_request(request: EngineCoreRequest) -> EngineCoreRequest:
    """What the prefill replica runs of ``request``: the request itself up to its first token, which streams; for one
    that :func:`runs_whole`, one greedy sample with no end but ``do_remote_decode`` (nor a grammar, nor logprobs)."""
    if not runs_whole(request):
        return dataclasses.replace(request, do_remote_decode=True)
    return dataclasses.replace(request, do_remote_decode=True, beam_params=None, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=None, seed=request.sampling_params.seed))


def _judge(result: KVImport, num_blocks: int) -> tuple[str, str | None]:
    """(outcome, cause) of a pull of ``num_blocks`` blocks."""
    if result.num_cached + result.num_inserted >= num_blocks:
        return "pulled", None
    cause = "blocks_refused" if result.num_received > result.num_inserted else "blocks_missing"
    return ("partial" if result.num_inserted else "recomputed"), cause

