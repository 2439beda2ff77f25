"""Getting a request onto an engine and keeping it on one: one ladder for a request's first send and for its
resumption after its engine died or moved it out.

A first send goes to the routed replica; if that one refuses it (it began draining) or its actor is down, nothing
was queued there, and the least-loaded other serving replica takes it from the start. A resume goes, with the
tokens the request has streamed so far and its seed, to the restarted replica or to another healthy one (waiting up
to ``RESUME_WAIT_S`` for one), where it continues: a greedy or seeded stream ends with exactly the tokens it would
have had. A request that loses its engine more than ``MAX_ENGINE_LOSSES`` times ends UNAVAILABLE.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import ray

from pagedserve.cluster.runtime.replica_health import ReplicaHealth, unwrap
from pagedserve.cluster.runtime.replicas import Replica
from pagedserve.cluster.runtime.routing import ReplicaPicker
from pagedserve.common.errors import (
    DuplicateRequestError,
    EngineUnavailableError,
    OverloadedError,
    ReplicaDrainingError,
)
from pagedserve.engine.core_types import EngineCoreRequest
from pagedserve.engine.output_processor import OutputProcessor

logger = logging.getLogger(__name__)

MAX_ENGINE_LOSSES = 3  # engines a request may lose and still finish
RESUME_WAIT_S = 120.0  # how long a request whose engine died waits for one that can take it


@dataclass(eq=False)
class InFlight:
    """A request this gateway runs, and what it takes to resume it on another engine."""

    request: EngineCoreRequest
    queue: asyncio.Queue
    replica: Replica
    seed: int | None = None  # the engine's base seed, once it took the request
    sent: asyncio.Event = field(default_factory=asyncio.Event)  # set once the first add_request has settled
    attempts: int = 0  # engines that died under it
    resuming: bool = False  # a resume is under way
    error: str | None = None  # why the engine ended it with an error
    invalid: bool = False  # and the error is the request's own (a grammar that does not compile): a 400, no retry
    refused: bool = False  # its replica refused the first send as the request's own fault: nothing was queued
    prefill: int = 0  # prompt tokens the router expects its replica to prefill, until the first output
    decode: int = 0  # output tokens it may still generate (estimated, capped)
    on_first_output: Callable[[], None] | None = None  # called (then cleared) when its first token arrives
    decode_target: Replica | None = None  # prefilled on a prefill replica: the decode replica picked for it
    # While on its prefill replica (``request`` is then what that one runs): the request its decode replica runs.
    decode_request: EngineCoreRequest | None = None

    def charge(self, r: Replica) -> None:
        r.work += self.prefill + self.decode

    def settle(self, new_tokens: int) -> None:
        """An output arrived: the prefill is done, and ``new_tokens`` of the decode."""
        done = self.prefill + min(new_tokens, self.decode)
        self.replica.work -= done
        self.prefill, self.decode = 0, self.decode - min(new_tokens, self.decode)

    def release(self) -> None:
        self.replica.work -= self.prefill + self.decode
        self.prefill = self.decode = 0

    def leave_prefill(self) -> None:
        """Off the prefill pool (handed off, or its prefill replica failed it): from here it runs as sent."""
        if self.decode_request is not None:
            self.request, self.decode_request = self.decode_request, None

    def move(self, target: Replica) -> None:
        self.replica.load -= 1
        self.replica.work -= self.prefill + self.decode
        self.replica = target
        target.load += 1
        self.charge(target)


class Resumption:
    """``inflight``: the router's requests by id (one gone from it was cancelled or finished)."""

    def __init__(self, health: ReplicaHealth, picker: ReplicaPicker, processor: OutputProcessor,
                 inflight: dict[str, InFlight]) -> None:
        self.health = health
        self.picker = picker
        self.processor = processor
        self.inflight = inflight

    async def send(self, rec: InFlight, session_id: str | None = None) -> None:
        """The first send, to ``rec.replica``; raises what ends the request (a ValueError, OverloadedError or
        EngineUnavailableError the replica raised is the request's own: nothing was queued)."""
        await self._climb(rec, resume=False, session_id=session_id)

    def resume_all(self, lost: Replica) -> None:
        for rec in [rec for rec in self.inflight.values() if rec.replica is lost]:
            asyncio.get_running_loop().create_task(self.resume(rec, lost))

    async def resume(self, rec: InFlight, lost: Replica) -> None:
        """Send a request whose engine (``lost``) died or moved it out to another (or the restarted) one, from where
        it stood. A target that turns out to be dying too (its node lost with the first) counts as one more engine
        lost: another takes the request, or that one once it has come back."""
        if rec.resuming:  # the replica it is moving to died: the resume under way sees it and goes on to another
            return
        rec.resuming = True
        try:
            if not rec.sent.is_set():
                # Its add_request is still under way: the lost replica may yet take it (a scale-in's drain), or
                # refuse it as it dies, and then ``send`` sends it to another itself.
                await rec.sent.wait()
                if rec.replica is not lost or self.inflight.get(rec.request.request_id) is not rec:
                    return
                if lost.alive:  # taken after it had ended this gateway's stream: free its blocks there
                    lost.actor.abort.remote([rec.request.request_id])
            await self._climb(rec, resume=True)
        finally:
            rec.resuming = False

    async def continue_on(self, rec: InFlight, target: Replica | None) -> None:
        """Go on with a request its prefill replica handed off, on ``target`` (its KV pulled there) or, if that
        one does not serve or dies taking it, on another, as a resume (from the tokens streamed, with its seed)."""
        if rec.resuming:
            return
        rec.resuming = True
        try:
            first = target if target is not None and target.serving else None
            if first is not None:
                rec.move(first)
            await self._climb(rec, resume=True, first=first)
        finally:
            rec.resuming = False

    async def wait_for_replica(self, avoid: dict[int, int] | None = None) -> Replica | None:
        """A replica that can serve a resumed request, waiting up to RESUME_WAIT_S for one; None if none comes."""
        deadline = asyncio.get_running_loop().time() + RESUME_WAIT_S
        while True:
            try:
                return self.picker.pick(avoid)
            except EngineUnavailableError:
                pass
            left = deadline - asyncio.get_running_loop().time()
            if all(r.out for r in self.health.replicas) or left <= 0:
                return None
            await self.health.changed(left)

    async def _climb(self, rec: InFlight, resume: bool, session_id: str | None = None,
                     first: Replica | None = None) -> None:
        """Offer the request to a replica, and on to another while each refuses it (draining) or dies taking it.
        A first send starts at ``rec.replica`` and raises what ends it; a resume starts at ``first`` (already
        ``rec.replica``) if given, else picks (and waits for) its replicas, and ends the request through its queue."""
        rid = rec.request.request_id
        failed: dict[int, int] = {}  # replica index -> its restarts when it failed this request
        target, why = first if resume else rec.replica, ""
        while True:
            if target is None:
                target = await self._next_resume(rec, failed) if resume else self._next_first(failed, why)
                if target is None:  # the request ended meanwhile, or it ended here
                    return
                rec.move(target)
                rec.leave_prefill()  # if its prefill replica failed it: the decode pool runs it whole
                if resume:
                    logger.info("resuming request %s on replica %d (attempt %d)", rid, target.index, rec.attempts)
                else:
                    self.picker.stick(session_id, target.index)
            generation = target.restarts  # as picked: if it comes back while this try fails, it may be tried again
            request = (dataclasses.replace(rec.request, resume=self.processor.resume_state(rid, rec.seed),
                                           do_remote_decode=False) if resume else rec.request)
            try:
                seed = await target.actor.add_request.remote(self.health.client_id, request)
                if not resume:
                    rec.seed = seed
                    rec.sent.set()
                    return
                if target.alive and target.restarts == generation:
                    return
                # It died as it took the request (whose outputs, if any, it sends no more: it is not the request's
                # replica once another takes it). Make sure a restarted one does not run it too.
                logger.warning("replica %d died taking request %s; trying another", target.index, rid)
                target.actor.abort.remote([rid])
            except ray.exceptions.RayTaskError as e:
                cause = unwrap(e)
                if not isinstance(cause, ReplicaDrainingError):
                    self._refused(rec, target, cause, resume)
                    return
                logger.info("replica %d is draining; sending request %s to another", target.index, rid)
                why = str(cause)  # draining before this gateway heard
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                logger.warning("replica %d failed taking request %s (%s); trying another", target.index, rid,
                               type(e).__name__)
                why = f"model replica {target.index} is unavailable: {type(e).__name__}"
            except ray.exceptions.RayError as e:
                self._end(rec, resume, EngineUnavailableError(
                    f"model replica {target.index} {'failed resuming it' if resume else 'is unavailable'}: "
                    f"{type(e).__name__}"))
                return
            failed[target.index] = generation
            target = None

    def _next_first(self, tried: dict[int, int], why: str) -> Replica:
        """After a refused first send: another replica that serves now (nothing was queued, none is waited for)."""
        target = self.picker.least_loaded(tried)
        if target is None:
            raise EngineUnavailableError(why)
        return target

    async def _next_resume(self, rec: InFlight, failed: dict[int, int]) -> Replica | None:
        """The replica for the request's next engine, waiting for one; None (the request ended) if there is none."""
        rec.attempts += 1
        error = None
        if rec.seed is None:
            error = "its model replica failed before it started; retry the request"
        elif rec.attempts > MAX_ENGINE_LOSSES:
            error = f"its model replica failed {rec.attempts} times; retry the request"
        target = None if error else await self.wait_for_replica(failed)
        if self.inflight.get(rec.request.request_id) is not rec:  # cancelled or finished meanwhile
            return None
        if target is None and error is None:
            states = "; ".join(f"replica {r.index}: {'out' if r.out else 'down' if not r.alive else 'serving'}"
                               for r in self.health.replicas) or "none left"
            error = f"no model replica came back to resume it ({states}); retry the request"
        if error is not None:
            rec.queue.put_nowait(EngineUnavailableError(error))
        return target

    def _refused(self, rec: InFlight, target: Replica, cause: BaseException, resume: bool) -> None:
        """The replica raised ``cause`` taking the request (not a drain)."""
        if resume and isinstance(cause, DuplicateRequestError):  # an earlier try reached it after all
            return
        if not resume and isinstance(cause, (ValueError, OverloadedError, EngineUnavailableError)):
            rec.refused = True
            raise cause from None
        self._end(rec, resume, EngineUnavailableError(
            f"model replica {target.index} {'failed resuming it' if resume else 'failed'}: {type(cause).__name__}"))

    @staticmethod
    def _end(rec: InFlight, resume: bool, error: EngineUnavailableError) -> None:
        if not resume:
            raise error from None
        rec.queue.put_nowait(error)
