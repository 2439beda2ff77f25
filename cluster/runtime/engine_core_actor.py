"""The engine-core actor: an async Ray actor that owns one replica's ``EngineCore`` (scheduler + executor) and
runs its step loop.

Gateways add processed requests (token ids) and receive every step's ``EngineCoreOutput`` batch through one
long-lived Ray streaming generator per gateway (``output_stream``): a push path, one object per step. The same
stream carries the step's prefix-cache events (``KVEventBatch``, to every gateway) and, first, a snapshot of the
cache (``KVCacheSnapshot``), so a router that connects late or reconnects starts from the cache as it is.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import ray
import torch
from prometheus_client.core import CounterMetricFamily

from pagedserve.cluster.runtime.core_metrics import EngineCoreMetrics
from pagedserve.cluster.runtime.lease import GATEWAY_LEASE_S, Leases
from pagedserve.cluster.runtime.preflight import NodeReport, PreflightFailed, node_checks
from pagedserve.common.errors import OverloadedError, ReplicaDrainingError
from pagedserve.common.outputs import EngineCoreOutput, EngineHealth
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.core_types import EngineCoreRequest, EngineInfo, EngineStats
from pagedserve.engine.engine_core import EngineCore
from pagedserve.engine.executor import RayPlacement, create_executor
from pagedserve.engine.kv_transfer import KVHandoff, KVImport, seal, verified
from pagedserve.scheduler.kv_events import BlockHash, KVCacheSnapshot, KVEvent, KVEventBatch

logger = logging.getLogger(__name__)

T = TypeVar("T")

class ActorExit(enum.IntEnum):
    """Why an engine-core actor ended its own process: Ray restarts it as after any death (``replicas.MAX_RESTARTS``)
    and the gateways resume its requests; the exit status tells the two causes apart."""

    STEP_HUNG = 70  # the watchdog found a step stalled past step_timeout, with the model in this process
    ENGINE_DEAD = 71  # the TP workers are gone for good (could not be rebuilt): a fresh actor rebuilds everything


@dataclass
class KVExportFaults:
    corrupt: int = 0
    stall: int = 0
    stall_s: float = 0.0


class EngineCoreActor:
    """Everything that touches the engine core runs on one thread, in order: steps back to back, and the adds,
    aborts and stats reads that arrive meanwhile in between two steps. The event loop only routes outputs.

    One thread because libgomp gives each thread that starts parallel work its own OpenMP team, and once the teams
    outnumber the cores it stops spinning between parallel regions, and the engine pays a context switch at every
    one. Steps back to back because a round trip through the event loop between two steps idled the engine for
    every dispatch.

    A watchdog (``step_timeout`` seconds, None: off) restarts an engine whose step makes no progress: it kills the
    TP workers, so the step fails and the core rebuilds them (the requests start over on the new group), or, with
    the model in this actor, ends the actor for Ray to restart (the gateway then resumes the requests).

    ``preflight_versions``: run the node's checks (``preflight.node_checks``, against these versions: the
    launcher's) before loading anything; a node that fails them gets no engine, and ``warmup`` raises
    ``PreflightFailed``. Not again when Ray restarts the actor: the node served already.
    """

    def __init__(self, engine_args: EngineArgs, max_waiting_requests: int | None = None,
                 num_threads: int | None = None, step_timeout: float | None = None,
                 gateway_lease_s: float = GATEWAY_LEASE_S,
                 preflight_versions: Mapping[str, str] | None = None, role: str = "both") -> None:
        self.role = role  # the router's ReplicaRole, for gateways that attach by name
        self._export_faults = KVExportFaults()  # see inject_kv_export_faults
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._preflight: NodeReport | None = None
        if preflight_versions is not None and not ray.get_runtime_context().was_current_actor_reconstructed:
            report = node_checks(engine_args.create_engine_config(), preflight_versions)
            if not report.ok:
                self._preflight = report
                return
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
        placement_group = ray.util.get_current_placement_group()  # read on the actor's thread (task context)
        self.core = self._engine_thread.submit(self._build_core, engine_args, num_threads, placement_group).result()
        self.core.take_kv_events()  # starts the recording
        self.metrics = EngineCoreMetrics(self.core)
        self.max_waiting_requests = max_waiting_requests
        self.step_timeout = step_timeout
        self.leases = Leases(gateway_lease_s)
        self._owner: dict[str, str] = {}  # request id -> gateway (client) id; event loop only
        self._queues: dict[str, asyncio.Queue] = {}
        self._lease_task: asyncio.Task | None = None
        self.num_orphaned = 0  # requests aborted because their gateway stopped renewing its lease
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stepping = False  # a step is queued on the engine thread; engine thread only
        self._stopped = False
        self._drain_reason: str | None = None  # why it drains, once it does
        self._step_started: float | None = None  # monotonic start of the step in progress (engine thread writes)
        self._healthy = EngineHealth(True)
        self._watchdog_task: asyncio.Task | None = None
        # Read before a step can hang: a hung worker answers no call, not even for its pid.
        self._worker_pids: list[int] = self.core.executor.worker_pids()

    def _build_core(self, engine_args: EngineArgs, num_threads: int | None, placement_group) -> EngineCore:
        if num_threads:
            torch.set_num_threads(num_threads)
        # With tensor parallelism the ranks sit in bundles 1..tp of this actor's placement group.
        placement = RayPlacement(placement_group, first_bundle=1)
        return EngineCore(engine_args.create_engine_config(), lambda cfg: create_executor(cfg, placement),
                          on_health=self._on_core_health)

    def _on_core_health(self, healthy: bool, reason: str) -> None:
        """Engine thread: the core stopped (or started again) being able to serve, or failed for good."""
        if healthy:
            self._worker_pids = self.core.executor.worker_pids()
        event = EngineHealth(healthy, reason, failed=self.core.failed is not None)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._broadcast, event)
        else:  # the launch warm-up: no gateway listens yet, a later one hears it on connecting
            self._healthy = event

    def _broadcast(self, event: EngineHealth) -> None:
        if self._drain_reason is not None and event.healthy:  # rebuilt workers while draining: still routed nothing new
            return
        self._healthy = event
        for q in self._queues.values():
            q.put_nowait([event])

    # ---- the engine thread -------------------------------------------------------------------------------------
    async def _on_engine(self, fn: Callable[..., T], *args) -> T:
        """Run ``fn`` on the engine thread, after the step in progress (if any)."""
        self._loop = asyncio.get_running_loop()
        return await self._loop.run_in_executor(self._engine_thread, fn, *args)

    def _kick(self) -> None:
        if not self._stepping and not self._stopped:
            self._stepping = True
            self._engine_thread.submit(self._step)

    def _step(self) -> None:
        """One step, then queue the next behind whatever arrived meanwhile (the executor runs in order)."""
        if self._stopped or not self.core.has_unfinished_requests():
            self._stepping = False
            return
        self._step_started = time.monotonic()
        try:
            outputs = self.core.step()
            self.metrics.on_step(outputs, self.core.last_step)
        except Exception as e:  # a bug, not a worker death (the core recovers from those)
            if self.core.dead:  # its workers are gone for good: Ray restarts this actor, the gateway resumes
                logger.exception("the engine cannot go on; ending this actor for Ray to restart it")
                os._exit(ActorExit.ENGINE_DEAD)
            logger.exception("engine step failed; failing the running requests")
            outputs = self.core.fail_step(e)
        finally:
            self._step_started = None
        events = self.core.take_kv_events()
        if outputs or events:
            self._loop.call_soon_threadsafe(self._dispatch, outputs, events)
        self._engine_thread.submit(self._step)

    def _add(self, request: EngineCoreRequest) -> int:
        if self.max_waiting_requests is not None and len(self.core.scheduler.waiting) >= self.max_waiting_requests:
            raise OverloadedError(f"the waiting queue is full ({self.max_waiting_requests} requests); retry later")
        req = self.core.add_request(request)
        self.metrics.track(req)
        self._kick()
        return req.seed

    def _abort(self, request_ids: list[str]) -> list[str]:
        found = [rid for rid in request_ids if self.core.abort_request(rid) is not None]
        self.metrics.reap()
        return found

    def _stop_sequence(self, request_id: str, index: int) -> None:
        self.core.stop_sequence(request_id, index)
        self.metrics.reap()

    # ---- the event loop ----------------------------------------------------------------------------------------
    def _queue(self, client_id: str) -> asyncio.Queue:
        return self._queues.setdefault(client_id, asyncio.Queue())

    async def add_request(self, client_id: str, request: EngineCoreRequest) -> int:
        """Queue a request; returns its base seed (what a resume on another engine needs). A draining replica refuses
        it (``ReplicaDrainingError``): the requests its drain waits for are those it took before, so a request sent
        while the drain began never runs here past it."""
        if self._drain_reason is not None:
            raise ReplicaDrainingError(f"model replica is draining: {self._drain_reason}")
        self._queue(client_id)
        self._owner[request.request_id] = client_id
        try:
            return await self._on_engine(self._add, request)
        except BaseException:
            self._owner.pop(request.request_id, None)
            raise

    async def abort(self, request_ids: list[str]) -> list[str]:
        """Abort requests; returns those that were running. Their blocks are free once this returns."""
        for rid in request_ids:
            self._owner.pop(rid, None)
        return await self._on_engine(self._abort, request_ids)

    async def stop_sequence(self, request_id: str, index: int) -> None:
        await self._on_engine(self._stop_sequence, request_id, index)

    def renew_lease(self, client_id: str) -> None:
        self.leases.renew(client_id)

    async def output_stream(self, client_id: str):
        """Yields lists of ``EngineCoreOutput`` for this client's requests, a list per step (or more if it lags), and
        ``EngineHealth`` events when the engine stops or starts being able to serve. Ends when the client stops
        renewing its lease (``gateway_lease_s``), aborting its requests."""
        q = self._queue(client_id)
        self.renew_lease(client_id)
        if not self._healthy.healthy:  # a gateway (re)connecting while the workers are being rebuilt
            q.put_nowait([self._healthy])
        self._loop = asyncio.get_running_loop()
        if self._lease_task is None:
            self._lease_task = self._loop.create_task(self._expire_leases())
        # Taken on the engine thread between steps and queued behind the events of the steps before it.
        self._engine_thread.submit(self._send_snapshot, client_id)
        try:
            while True:
                batch = await q.get()
                if client_id in self.leases.ending:
                    return
                while not q.empty():
                    batch += q.get_nowait()
                yield batch
        finally:
            self.leases.forget(client_id)
            self._queues.pop(client_id, None)
            stale = [rid for rid, c in self._owner.items() if c == client_id]
            if stale:
                await self.abort(stale)

    async def _expire_leases(self) -> None:
        while not self._stopped:
            await asyncio.sleep(self.leases.check_every_s)
            if self.core.scheduler.kv_leases.leases:
                await self._on_engine(self.core.expire_kv_leases)
            for client, silent in self.leases.overdue(self._queues):
                orphans = sum(c == client for c in self._owner.values())
                logger.warning("gateway %s not heard from for %.0f s: taking it for dead and aborting its %d requests",
                               client, silent, orphans)
                self.num_orphaned += orphans
                self._end_stream(client)

    def _end_stream(self, client_id: str) -> None:
        self.leases.ending.add(client_id)
        self._queues[client_id].put_nowait([])  # wakes its stream, which ends and aborts the gateway's requests

    def _send_snapshot(self, client_id: str) -> None:
        """Engine thread."""
        snapshot = self.core.kv_snapshot()
        self._loop.call_soon_threadsafe(self._put, client_id, snapshot)

    def _put(self, client_id: str, item: KVCacheSnapshot) -> None:
        q = self._queues.get(client_id)
        if q is not None:
            q.put_nowait([item])

    def _dispatch(self, outputs: list[EngineCoreOutput], events: list[KVEvent]) -> None:
        batches: dict[str, list[EngineCoreOutput | KVEventBatch]] = {}
        if events:  # every gateway routes by them; one object per step, whoever's requests ran
            kv = KVEventBatch(events)
            batches = {client: [kv] for client in self._queues}
        for out in outputs:
            client = self._owner.pop(out.request_id, None) if out.finished else self._owner.get(out.request_id)
            if client is not None and client in self._queues:
                batches.setdefault(client, []).append(out)
        for client, batch in batches.items():
            self._queues[client].put_nowait(batch)

    async def warmup(self) -> None:
        """Run one tiny request through the whole path (the health check turns SERVING after this); a no-op on a
        replica that is serving already (a gateway checking a restarted replica). Starts the step watchdog.
        Raises ``EngineUnavailableError`` with the model's error when the model cannot run it, ``PreflightFailed``
        when the node failed its checks."""
        if self._preflight is not None:
            raise PreflightFailed(self._preflight)
        await self._on_engine(self.core.warmup)
        if self.step_timeout and self._watchdog_task is None:
            self._watchdog_task = asyncio.get_running_loop().create_task(self._watchdog())

    async def _watchdog(self) -> None:
        while not self._stopped:
            await asyncio.sleep(min(1.0, self.step_timeout / 4))
            started = self._step_started
            if started is None or not self._healthy.healthy or time.monotonic() - started < self.step_timeout:
                continue
            reason = f"an engine step made no progress for {self.step_timeout:.0f} s; restarting the engine"
            logger.error(reason)
            self._broadcast(EngineHealth(False, reason))
            if not self._worker_pids:  # the model runs in this process: Ray restarts the actor, the gateway resumes
                os._exit(ActorExit.STEP_HUNG)
            for pid in self._worker_pids:  # the hung step fails with WorkerFailedError; the core rebuilds the group
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # ---- scale-in and replacement -----------------------------------------------------------------------------
    def begin_drain(self, reason: str) -> None:
        """Tell every gateway, now and on connecting, to route nothing new here."""
        self._drain_reason = reason
        self._broadcast(EngineHealth(False, reason, draining=True))

    def num_owned_requests(self) -> int:
        """Requests a gateway still waits on here."""
        return len(self._owner)

    async def migrate_out(self) -> int:
        """End every gateway's stream: each aborts its requests here (freeing their blocks) and resumes them on
        another replica with the tokens streamed so far and the same seed (see ``replica_health``). Returns how
        many requests were running."""
        moved = len(self._owner)
        for client in list(self._queues):
            self._end_stream(client)
        return moved

    # ---- KV handoff (engine/kv_transfer.py) ---------------------------------------------------------------------
    def get_role(self) -> str:
        return self.role

    async def export_kv(self, block_hashes: list[BlockHash]) -> KVHandoff:
        """The producer side: the KV of the leading run of these cached blocks, every TP rank's, sealed with their
        checksums off the engine thread."""
        faults = self._export_faults
        if faults.stall > 0:
            faults.stall -= 1
            await asyncio.sleep(faults.stall_s)
        handoff = await asyncio.to_thread(seal, await self._on_engine(self.core.read_kv, block_hashes))
        if faults.corrupt > 0 and handoff.num_blocks > 1:
            faults.corrupt -= 1
            handoff.ranks[-1].k[0, 1].view(torch.uint8).view(-1)[0] ^= 0xFF  # the second block, after sealing
        return handoff

    def inject_kv_export_faults(self, corrupt: int = 0, stall: int = 0, stall_s: float = 60.0) -> None:
        """Fault injection (tests, drills): flip a byte of the second block of the next ``corrupt`` exports after
        their checksums were taken, as a bad link or bad memory would; hold the next ``stall`` exports ``stall_s``
        seconds before they read anything, as an overloaded producer would."""
        self._export_faults = KVExportFaults(corrupt, stall, stall_s)

    async def release_kv(self, request_id: str) -> bool:
        return await self._on_engine(self.core.release_kv, request_id)

    async def pull_kv(self, producer: ray.actor.ActorHandle, block_hashes: list[BlockHash]) -> KVImport:
        """The consumer side: fetch from ``producer`` (another replica's actor) the blocks of this chain not cached
        here, straight from actor to actor, check them off the engine thread, and put the intact leading ones into
        the prefix cache."""
        have = await self._on_engine(self.core.num_cached_blocks, block_hashes)
        if have == len(block_hashes):
            return KVImport(have)
        handoff = await producer.export_kv.remote(block_hashes[have:])
        intact = await asyncio.to_thread(verified, handoff)
        if intact.num_blocks < handoff.num_blocks:
            logger.warning("KV handoff: %d of %d blocks failed their checksum; they are recomputed",
                           handoff.num_blocks - intact.num_blocks, handoff.num_blocks)
        inserted = await self._on_engine(self.core.write_kv, intact, block_hashes[have - 1] if have else None)
        return KVImport(have, handoff.num_blocks, inserted, handoff.nbytes)

    async def kv_snapshot(self) -> KVCacheSnapshot:
        """Every block hash in the prefix cache now (a router resyncs from it)."""
        return await self._on_engine(self.core.kv_snapshot)

    def get_info(self) -> EngineInfo:
        return self.core.get_info()

    async def get_stats(self) -> EngineStats:
        return await self._on_engine(self.core.get_stats)

    async def get_metrics(self) -> list:
        """Prometheus metric families measured here (the gateway's /metrics serves them)."""
        orphaned = CounterMetricFamily("pagedserve_orphaned_requests", "Requests aborted because the gateway that "
                                       "sent them stopped renewing its lease (it died).")
        orphaned.add_metric([], self.num_orphaned)
        return [*await self._on_engine(self.metrics.collect), orphaned]

    def get_node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()

    def worker_pids(self) -> list[int]:
        """Process ids of the TP worker actors (empty when the model runs in this actor)."""
        return self.core.executor.worker_pids()

    async def shutdown(self) -> None:
        if self._preflight is not None:  # no engine was built
            return

        def stop() -> None:
            self._stopped = True
            self.core.shutdown()

        await self._on_engine(stop)
