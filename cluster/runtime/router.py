"""The router over a serving cluster's replicas (the gateway's ``EngineClient``): processes each request once,
picks a replica by its routing policy (see ``routing``) and session affinity, receives every replica's output stream
(one Ray streaming generator each: outputs, health and prefix-cache events) and turns token ids into text with an
``OutputProcessor``."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import ray
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedserve.cluster.runtime.engine_core_actor import GATEWAY_LEASE_S
from pagedserve.cluster.runtime.replicas import Replica
from pagedserve.cluster.runtime.routing import (
    AFFINITY_REASONS,
    DECODE_ESTIMATE_CAP,
    REASONS,
    LeastLoaded,
    Pick,
    RouteRequest,
    RoutingPolicy,
)
from pagedserve.engine.core_types import EngineCoreRequest, EngineInfo, EngineStats
from pagedserve.engine.input_processor import InputProcessor, PromptType
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.protocol import EngineClient
from pagedserve.errors import (
    DuplicateRequestError,
    EngineUnavailableError,
    InvalidRequestError,
    OverloadedError,
    ReplicaDrainingError,
)
from pagedserve.outputs import BeamSearchOutput, EngineCoreOutput, EngineHealth, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.scheduler.block_manager import prompt_block_hashes
from pagedserve.scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheSnapshot, KVEventBatch

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0
INLINE_TOKENIZE_CHARS = 16_384  # longer text prompts are tokenized on a worker thread
MAX_RESUMES = 3  # engines a request may lose and still finish
RESUME_WAIT_S = 120.0  # how long a request whose engine died waits for one that can take it
# A session's replica is overloaded (the session moves) when it runs more than this many times the requests of the
# least-loaded serving replica, plus the slack.
AFFINITY_OVERLOAD_RATIO = 2
AFFINITY_OVERLOAD_SLACK = 4
MAX_SESSIONS = 100_000  # sessions remembered, least recently used dropped first
MAX_TTFT_SAMPLES = 10_000


def unwrap(e: BaseException) -> BaseException:
    """The user's exception inside a Ray task error (ValueError, OverloadedError, ...)."""
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(getattr(e, "cause", None), BaseException):
        return e.cause
    return e


@dataclass(eq=False)
class ReplicaState:
    """A replica as this gateway sees it."""

    replica: Replica
    load: int = 0  # running requests, from this gateway
    work: int = 0  # their tokens still to prefill and (estimated) to generate (see ``routing``)
    cached: set[bytes] = field(default_factory=set)  # block hashes in its prefix cache, from its KV events
    alive: bool = True  # its actor is up
    ready: bool = True  # and not rebuilding its workers
    gone: bool = False  # dead for good (Ray's restarts spent)
    error: str | None = None  # failed for good: its model fails every step the same way (the error)
    retiring: bool = False  # draining for a scale-in or a replacement; dropped from the list once its actor ends
    restarts: int = 0  # times this gateway saw its actor come back

    @property
    def index(self) -> int:
        return self.replica.index

    @property
    def actor(self) -> ray.actor.ActorHandle:
        return self.replica.actor

    @property
    def serving(self) -> bool:
        return self.alive and self.ready and self.error is None

    @property
    def out(self) -> bool:
        """It will not serve again without an operator (restart the server once the model is fixed)."""
        return self.gone or self.error is not None


@dataclass(eq=False)
class _InFlight:
    """A request this gateway runs, and what it takes to resume it on another engine."""

    request: EngineCoreRequest
    queue: asyncio.Queue
    replica: ReplicaState
    seed: int | None = None  # the engine's base seed, once it took the request
    sent: asyncio.Event = field(default_factory=asyncio.Event)  # set once the first add_request has settled
    attempts: int = 0  # engines that died under it
    resuming: bool = False  # a resume is under way
    error: str | None = None  # why the engine ended it with an error
    invalid: bool = False  # and the error is the request's own (a grammar that does not compile): a 400, no retry
    prefill: int = 0  # prompt tokens the router expects its replica to prefill, until the first output
    decode: int = 0  # output tokens it may still generate (estimated, capped)

    def charge(self, r: ReplicaState) -> None:
        r.work += self.prefill + self.decode

    def settle(self, new_tokens: int) -> None:
        """An output arrived: the prefill is done, and ``new_tokens`` of the decode."""
        done = self.prefill + min(new_tokens, self.decode)
        self.replica.work -= done
        self.prefill, self.decode = 0, self.decode - min(new_tokens, self.decode)

    def release(self) -> None:
        self.replica.work -= self.prefill + self.decode
        self.prefill = self.decode = 0


class ReplicaRouter(EngineClient):
    """``infos``: each replica's ``EngineInfo``; requests are validated against the smallest KV pool.

    When a replica's engine-core actor dies, its requests are resumed rather than failed: each goes, with the
    tokens it has streamed so far and its seed, to the restarted replica or to another healthy one, and continues
    where it stopped (a greedy or seeded stream ends with exactly the tokens it would have had). A request that
    loses its engine more than ``MAX_RESUMES`` times, or finds none within ``RESUME_WAIT_S``, ends UNAVAILABLE.
    """

    def __init__(self, replicas: list[Replica], tokenizer, infos: list[EngineInfo],
                 policy: RoutingPolicy | None = None) -> None:
        self.replicas = [ReplicaState(r) for r in replicas]
        self.policy = policy or LeastLoaded()
        self._sessions: OrderedDict[str, int] = OrderedDict()  # session id -> replica index it last used
        # Every (policy, reason) at zero from the start; only values change after (read on the scrape thread).
        self.decisions = {reason: 0 for reason in REASONS[self.policy.name] + AFFINITY_REASONS}
        self.info = dataclasses.replace(infos[0], num_kv_blocks=min(i.num_kv_blocks for i in infos))
        self.client_id = uuid.uuid4().hex
        self.input_processor = InputProcessor(tokenizer, self.info)
        self.processor = OutputProcessor(tokenizer, self._stop_sequence, self.info.stream_interval)
        self._inflight: dict[str, _InFlight] = {}
        self._pumps: list[asyncio.Task] = []
        self._health_listeners: list[Callable[[], Awaitable[None]]] = []
        self._changed = asyncio.Event()  # set (and replaced) whenever a replica's state changes
        self._ttfts: deque[float] = deque(maxlen=MAX_TTFT_SAMPLES)  # seconds to first output, since last taken
        self.metric_sources: list[Callable[[], list[Metric]]] = []  # more families for /metrics (the autoscaler)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._pumps = [loop.create_task(self._pump(r)) for r in self.replicas] + [loop.create_task(self._renew())]

    async def add_replica(self, replica: Replica) -> None:
        """Route to one more (warmed-up) replica: a scale-out, or a replacement during a rollout."""
        if any(r.index == replica.index for r in self.replicas):
            return
        r = ReplicaState(replica)
        self.replicas.append(r)
        self._pumps.append(asyncio.get_running_loop().create_task(self._pump(r)))
        logger.info("replica %d added (%d serving)", r.index, self.num_replicas)
        await self._set_state(r)

    def take_ttfts(self) -> list[float]:
        """Times to first output of the requests that started since the last call (the autoscaler's TTFT)."""
        out = list(self._ttfts)
        self._ttfts.clear()
        return out

    @property
    def num_replicas(self) -> int:
        return sum(r.serving for r in self.replicas)

    def _replica(self, index: int) -> ReplicaState | None:
        return next((r for r in self.replicas if r.index == index), None)

    async def _renew(self) -> None:
        """Renew this gateway's lease on every replica (see ``GATEWAY_LEASE_S``), never waiting on a slow one."""
        async def renew(r: ReplicaState) -> None:
            with contextlib.suppress(Exception):  # a dead or restarting replica: its pump handles it
                await asyncio.wait_for(r.actor.renew_lease.remote(self.client_id), GATEWAY_LEASE_S)

        tasks: set[asyncio.Task] = set()
        while True:
            for r in self.replicas:
                if r.alive and not r.out:
                    task = asyncio.get_running_loop().create_task(renew(r))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            await asyncio.sleep(GATEWAY_LEASE_S / 5)

    @property
    def num_running(self) -> int:
        return len(self._inflight)

    def _stop_sequence(self, request_id: str, index: int) -> None:
        rec = self._inflight.get(request_id)
        if rec is not None:
            rec.replica.actor.stop_sequence.remote(request_id, index)

    # ---- replica state -----------------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return any(r.serving for r in self.replicas)

    @property
    def health_detail(self) -> str:
        """Why no replica serves (each replica's state, with the error of one whose model failed)."""
        if self.healthy:
            return ""
        parts = []
        for r in self.replicas:
            state = (f"failed: {r.error}" if r.error is not None else "gone" if r.gone
                     else "restarting" if not r.alive else "rebuilding its workers")
            parts.append(f"replica {r.index} {state}")
        return "; ".join(parts)

    def add_health_listener(self, listener: Callable[[], Awaitable[None]]) -> None:
        self._health_listeners.append(listener)

    async def _set_state(self, r: ReplicaState, *, alive: bool | None = None, ready: bool | None = None) -> None:
        if alive is not None:
            r.alive = alive
        if ready is not None:
            r.ready = ready
        self._changed.set()
        self._changed = asyncio.Event()
        for listener in self._health_listeners:
            await listener()

    def _live(self) -> list[ReplicaState]:
        live = [r for r in self.replicas if r.serving]
        if not live:
            raise EngineUnavailableError(f"no model replica is available ({self.health_detail})")
        return live

    def _route(self, request: EngineCoreRequest, session_id: str | None = None) -> Pick[ReplicaState]:
        """The replica for a new request, from the replicas' state as it is now (a replica that is restarting or
        rebuilding is skipped, never waited on). A session sticks to its last replica while that serves and is not
        overloaded (see ``AFFINITY_OVERLOAD_RATIO``)."""
        live = self._live()
        ids = request.prompt_token_ids
        route = RouteRequest(len(ids), prompt_block_hashes(ids, self.info.block_size, request.cache_salt)
                             if self.policy.needs_block_hashes else [], self.info.block_size)
        pick = None
        if session_id is not None and (last := self._sessions.get(session_id)) is not None:
            r = self._replica(last)
            least = min(x.load for x in live)
            if r is not None and r.serving and r.load <= AFFINITY_OVERLOAD_RATIO * least + AFFINITY_OVERLOAD_SLACK:
                pick = Pick(r, "affinity")
            else:
                pick = dataclasses.replace(self.policy.pick(live, route), reason="affinity_fallback")
        if pick is None:
            pick = self.policy.pick(live, route)
        # Counted as cached there before the replica's events say so: a burst of one tenant's first requests then
        # follows the first instead of spreading over replicas that will each prefill the prefix again.
        pick.replica.cached.update(route.block_hashes)
        if session_id is not None:
            self._sessions[session_id] = pick.replica.index
            self._sessions.move_to_end(session_id)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        self.decisions[pick.reason] += 1
        return pick

    def _pick(self, avoid: dict[int, int] | None = None) -> ReplicaState:
        """Any replica that serves now, for a request resumed from a dead one (its prompt and progress moved).
        ``avoid``: replica index -> its ``restarts`` when it failed this request (taken again once it came back)."""
        live = [r for r in self._live() if avoid is None or avoid.get(r.index) != r.restarts]
        if not live:
            raise EngineUnavailableError("every serving replica failed taking this request")
        return self.policy.pick(live, None).replica

    async def _wait_for_replica(self, avoid: dict[int, int] | None = None) -> ReplicaState | None:
        """A replica that can serve a resumed request, waiting up to RESUME_WAIT_S for one; None if none comes."""
        deadline = asyncio.get_running_loop().time() + RESUME_WAIT_S
        while True:
            with contextlib.suppress(EngineUnavailableError):
                return self._pick(avoid)
            left = deadline - asyncio.get_running_loop().time()
            if all(r.out for r in self.replicas) or left <= 0:
                return None
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    # ---- receiving ---------------------------------------------------------------------------------------------
    async def _pump(self, r: ReplicaState) -> None:
        """Receive the replica's outputs; when its actor dies, resume its requests and wait for Ray to restart it."""
        i = r.index
        while True:
            gen = r.actor.output_stream.options(num_returns="streaming").remote(self.client_id)
            try:
                async for ref in gen:
                    await self._deliver(r, await ref)
                # The replica ended the stream: it is moving its requests out (a scale-in), or it heard no lease
                # renewal from this gateway in time (a stalled event loop); either way it aborted this gateway's
                # requests there. Resume them elsewhere and listen again.
                if r.retiring:
                    logger.info("replica %d is draining; moving its requests to other replicas", i)
                else:
                    logger.warning("replica %d took this gateway for dead; resuming its requests", i)
                for rec in [rec for rec in self._inflight.values() if rec.replica is r]:
                    asyncio.get_running_loop().create_task(self._resume(rec, r))
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if r.retiring:
                    logger.info("replica %d ended", i)
                else:
                    logger.error("replica %d failed: %s", i, e)
            await self._set_state(r, alive=False)
            r.cached.clear()  # a restarted engine starts with an empty cache; its snapshot says so on reconnecting
            for rec in [rec for rec in self._inflight.values() if rec.replica is r]:
                asyncio.get_running_loop().create_task(self._resume(rec, r))
            restarted = await self._await_restart(r)
            if restarted is not True:
                if isinstance(restarted, str):
                    r.error = restarted
                else:
                    r.gone = True
                if r.retiring:
                    self.replicas.remove(r)
                    logger.info("replica %d released (%d serving)", i, self.num_replicas)
                await self._set_state(r)
                return
            logger.info("replica %d restarted", i)
            r.restarts += 1
            await self._set_state(r, alive=True, ready=True)

    @staticmethod
    async def _await_restart(r: ReplicaState) -> bool | str:
        """Wait for Ray to restart the actor (``max_restarts``); False once it is dead for good (as a retiring one
        ends), the model's error if the restarted one cannot run its warm-up request."""
        while True:
            try:
                await r.actor.warmup.remote()
                return True
            except ray.exceptions.ActorUnavailableError:  # restarting
                await asyncio.sleep(0.5)
            except ray.exceptions.RayTaskError as e:
                logger.error("replica %d restarted but cannot serve: %s", r.index, unwrap(e))
                return str(unwrap(e))
            except ray.exceptions.RayActorError as e:
                if not r.retiring:
                    logger.error("replica %d is gone for good: %s", r.index, e)
                return False

    @staticmethod
    def _apply_kv_events(r: ReplicaState, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                r.cached.add(ev.block_hash)
            elif isinstance(ev, BlockRemoved):
                r.cached.discard(ev.block_hash)
            elif isinstance(ev, AllBlocksCleared):
                r.cached.clear()

    async def _deliver(self, r: ReplicaState,
                       batch: list[EngineCoreOutput | EngineHealth | KVEventBatch | KVCacheSnapshot]) -> None:
        outputs = []
        for item in batch:
            if isinstance(item, KVEventBatch):
                self._apply_kv_events(r, item)
            elif isinstance(item, KVCacheSnapshot):
                r.cached = set(item.block_hashes)
            elif isinstance(item, EngineHealth):
                if item.draining:
                    if not r.retiring:
                        logger.info("replica %d draining: %s", r.index, item.reason)
                    r.retiring = True
                elif item.failed:
                    logger.error("replica %d failed: its model fails every step the same way: %s; it is no longer "
                                 "routed to", r.index, item.reason)
                    r.error = item.reason
                elif not r.retiring:
                    logger.log(logging.INFO if item.healthy else logging.WARNING, "replica %d %s", r.index,
                               "serves again" if item.healthy else f"cannot serve: {item.reason}")
                await self._set_state(r, ready=item.healthy and not r.retiring)
            else:
                rec = self._inflight.get(item.request_id)
                if rec is not None and rec.replica is not r:  # sent before the request moved: stale
                    continue
                outputs.append(item)
                if item.error is not None and rec is not None:
                    rec.error, rec.invalid = item.error, item.invalid_request
        for out in self.processor.process(outputs):
            rec = self._inflight.get(out.request_id)
            if rec is not None:
                rec.queue.put_nowait(out)

    @staticmethod
    def _move(rec: _InFlight, target: ReplicaState) -> None:
        rec.replica.load -= 1
        rec.replica.work -= rec.prefill + rec.decode
        rec.replica = target
        target.load += 1
        rec.charge(target)

    async def _resume(self, rec: _InFlight, lost: ReplicaState) -> None:
        """Send a request whose engine (``lost``) died or moved it out to another (or the restarted) one, from where
        it stood. A target that turns out to be dying too (its node lost with the first) counts as one more engine
        lost: another takes the request, or that one once it has come back."""
        if rec.resuming:  # the replica it is moving to died: the resume under way sees it and goes on to another
            return
        rec.resuming = True
        try:
            if not rec.sent.is_set():
                # Its add_request is still under way: the lost replica may yet take it (a scale-in's drain), or
                # refuse it as it dies, and then ``generate`` sends it to another itself.
                await rec.sent.wait()
                if rec.replica is not lost or self._inflight.get(rec.request.request_id) is not rec:
                    return
                if lost.alive:  # taken after it had ended this gateway's stream: free its blocks there
                    lost.actor.abort.remote([rec.request.request_id])
            await self._resume_loop(rec)
        finally:
            rec.resuming = False

    async def _resume_loop(self, rec: _InFlight) -> None:
        rid = rec.request.request_id
        failed: dict[int, int] = {}
        while True:
            rec.attempts += 1
            error = None
            if rec.seed is None:
                error = "its model replica failed before it started; retry the request"
            elif rec.attempts > MAX_RESUMES:
                error = f"its model replica failed {rec.attempts} times; retry the request"
            target = None if error else await self._wait_for_replica(failed)
            if self._inflight.get(rid) is not rec:  # cancelled or finished meanwhile
                return
            if target is None and error is None:
                states = "; ".join(f"replica {r.index}: {'out' if r.out else 'down' if not r.alive else 'serving'}"
                                   for r in self.replicas) or "none left"
                error = f"no model replica came back to resume it ({states}); retry the request"
            if error is not None:
                rec.queue.put_nowait(EngineUnavailableError(error))
                return
            state = self.processor.resume_state(rid, rec.seed)
            generation = target.restarts  # as picked: if it comes back while this try fails, it may be tried again
            self._move(rec, target)
            logger.info("resuming request %s on replica %d (attempt %d)", rid, target.index, rec.attempts)
            try:
                await target.actor.add_request.remote(self.client_id, dataclasses.replace(rec.request, resume=state))
                if target.alive and target.restarts == generation:
                    return
                # It died as it took the request (whose outputs, if any, it sends no more: it is not the request's
                # replica once another takes it). Make sure a restarted one does not run it too.
                logger.warning("replica %d died taking request %s; trying another", target.index, rid)
                target.actor.abort.remote([rid])
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                logger.warning("replica %d failed taking request %s (%s); trying another", target.index, rid,
                               type(e).__name__)
            except ray.exceptions.RayTaskError as e:
                if isinstance(unwrap(e), ReplicaDrainingError):  # draining before this gateway heard: another
                    logger.info("replica %d is draining; resuming request %s on another", target.index, rid)
                else:
                    if not isinstance(unwrap(e), DuplicateRequestError):  # else an earlier try reached it after all
                        rec.queue.put_nowait(EngineUnavailableError(
                            f"model replica {target.index} failed resuming it: {type(unwrap(e)).__name__}"))
                    return
            except ray.exceptions.RayError as e:
                rec.queue.put_nowait(EngineUnavailableError(
                    f"model replica {target.index} failed resuming it: {type(e).__name__}"))
                return
            failed[target.index] = generation

    # ---- the EngineClient API ----------------------------------------------------------------------------------
    async def process(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams | None,
                      cache_salt: str | None = None) -> tuple[str | None, EngineCoreRequest]:
        if request_id in self._inflight:
            raise InvalidRequestError(f"request_id {request_id!r} is already running")
        constrained = isinstance(params, SamplingParams) and params.structured_outputs is not None
        if constrained or (isinstance(prompt, str) and len(prompt) > INLINE_TOKENIZE_CHARS):
            # Long prompts are tokenized, and grammars checked, off the event loop, which streams every other
            # request meanwhile.
            return await asyncio.to_thread(self.input_processor.process, request_id, prompt, params, cache_salt)
        return self.input_processor.process(request_id, prompt, params, cache_salt)

    async def generate(self, prompt: str | None, request: EngineCoreRequest, stream: bool = True,
                       session_id: str | None = None) -> AsyncIterator[RequestOutput | BeamSearchOutput]:
        request_id = request.request_id
        if request_id in self._inflight:
            raise InvalidRequestError(f"request_id {request_id!r} is already running")
        pick = self._route(request, session_id)
        max_tokens = request.sampling_params.max_tokens or DECODE_ESTIMATE_CAP
        rec = _InFlight(request, asyncio.Queue(), pick.replica,
                        prefill=len(request.prompt_token_ids) - pick.num_cached_tokens,
                        decode=min(max_tokens, DECODE_ESTIMATE_CAP))
        self._inflight[request_id] = rec
        rec.replica.load += 1
        rec.charge(rec.replica)
        finished = False
        started = asyncio.get_running_loop().time()
        first = True
        try:
            self.processor.add_request(request_id, prompt, request.prompt_token_ids, request.params, stream,
                                       delta=True)
            tried: set[int] = set()
            while True:
                i = rec.replica.index
                try:
                    rec.seed = await rec.replica.actor.add_request.remote(self.client_id, request)
                    rec.sent.set()
                    break
                except ray.exceptions.RayTaskError as e:
                    cause = unwrap(e)
                    if isinstance(cause, ReplicaDrainingError):  # before its stream told us: another takes it
                        why = str(cause)
                    elif isinstance(cause, (ValueError, OverloadedError, EngineUnavailableError)):
                        finished = True  # nothing was queued
                        raise cause from None
                    else:
                        raise EngineUnavailableError(f"model replica {i} failed: {type(cause).__name__}") from None
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                    # Its actor died (or is restarting) before its stream told us: nothing was queued there, another
                    # replica takes it.
                    why = f"model replica {i} is unavailable: {type(e).__name__}"
                except ray.exceptions.RayError as e:
                    raise EngineUnavailableError(f"model replica {i} is unavailable: {type(e).__name__}") from None
                tried.add(i)
                others = [r for r in self.replicas if r.serving and r.index not in tried]
                if not others:
                    raise EngineUnavailableError(why)
                self._move(rec, min(others, key=lambda r: r.load))
                if session_id is not None:
                    self._sessions[session_id] = rec.replica.index
            while True:
                item = await rec.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, RequestOutput) and any(c.finish_reason == "error" for c in item.outputs):
                    finished = True
                    if rec.invalid:
                        raise InvalidRequestError(rec.error)
                    raise EngineUnavailableError(f"{rec.error}; retry the request" if rec.error else
                                                 "the model workers failed under this request repeatedly; retry it")
                finished = item.finished
                rec.settle(sum(len(c.token_ids) for c in item.outputs) if isinstance(item, RequestOutput) else 0)
                if first:
                    self._ttfts.append(asyncio.get_running_loop().time() - started)
                    first = False
                yield item
                if finished:
                    return
        finally:
            rec.sent.set()  # a resume waiting for the replica's answer sees the request is gone
            self._inflight.pop(request_id, None)
            rec.replica.load -= 1
            rec.release()
            self.processor.abort(request_id)
            if not finished and rec.replica.alive:
                rec.replica.actor.abort.remote([request_id])

    async def abort(self, request_id: str) -> bool:
        """End a running request: its stream ends with finish reason "abort"."""
        rec = self._inflight.get(request_id)
        if rec is None:
            return False
        out = self.processor.abort_output(request_id)
        await rec.replica.actor.abort.remote([request_id])
        if out is not None:
            rec.queue.put_nowait(out)
        return True

    async def get_stats(self) -> list[EngineStats]:
        """Every live replica's; one that fails to answer (dying, restarting) is left out."""
        stats = await asyncio.gather(*[r.actor.get_stats.remote() for r in self.replicas if r.alive],
                                     return_exceptions=True)
        return [s for s in stats if isinstance(s, EngineStats)]

    def collect_metrics(self) -> list[Metric]:
        """Every live replica's metric families, their samples labelled ``replica``, and the workers-up gauges."""
        tp = self.info.tensor_parallel_size
        up = GaugeMetricFamily("pagedserve_workers_up", "Model workers (TP ranks) alive, per replica.",
                               labels=["replica"])
        expected = GaugeMetricFamily("pagedserve_workers_expected",
                                     "Model workers (TP ranks) configured, per replica.", labels=["replica"])
        merged: dict[str, Metric] = {}
        for r in self.replicas:
            label = str(r.index)
            expected.add_metric([label], tp)
            families = None
            if r.alive:
                try:
                    families = ray.get(r.actor.get_metrics.remote(), timeout=SCRAPE_TIMEOUT_S)
                except Exception as e:  # a dying replica must not break the scrape
                    logger.warning("replica %d metrics unavailable: %s", r.index, e)
            up.add_metric([label], tp if families is not None else 0)
            for fam in families or []:
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for smp in fam.samples:
                    out.add_sample(smp.name, {"replica": label, **smp.labels}, smp.value, smp.timestamp)
        decisions = CounterMetricFamily("pagedserve_routing_decisions", "Requests routed, by policy and reason.",
                                        labels=["policy", "reason"])
        for reason, n in list(self.decisions.items()):
            decisions.add_metric([self.policy.name, reason], n)
        serving = GaugeMetricFamily("pagedserve_serving_replicas",
                                    "Model replicas serving now (scaling, draining and failures change it).")
        serving.add_metric([], self.num_replicas)
        extra = [fam for source in self.metric_sources for fam in source()]
        return [up, expected, decisions, serving, *extra, *merged.values()]

    async def close(self) -> None:
        for t in self._pumps:
            t.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
