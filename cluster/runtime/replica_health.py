"""A gateway's view of its replicas' health: it receives every replica's output stream (one Ray streaming generator
each: outputs, health and prefix-cache events), follows each actor through its deaths and Ray's restarts, and renews
the gateway's lease on each replica (see ``lease``). Outputs and lost replicas go to the router's callbacks."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import ray

from pagedserve.cluster.runtime.lease import GATEWAY_LEASE_S
from pagedserve.cluster.runtime.replicas import Replica, health_detail
from pagedserve.common.outputs import EngineCoreOutput, EngineHealth
from pagedserve.scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheSnapshot, KVEventBatch

logger = logging.getLogger(__name__)

StreamItem = EngineCoreOutput | EngineHealth | KVEventBatch | KVCacheSnapshot


def unwrap(e: BaseException) -> BaseException:
    """The user's exception inside a Ray task error (ValueError, OverloadedError, ...)."""
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(getattr(e, "cause", None), BaseException):
        return e.cause
    return e


def apply_kv_events(r: Replica, batch: KVEventBatch) -> None:
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            r.cached.add(ev.block_hash)
        elif isinstance(ev, BlockRemoved):
            r.cached.discard(ev.block_hash)
        elif isinstance(ev, AllBlocksCleared):
            r.cached.clear()


class ReplicaHealth:
    """``on_outputs``: a replica's request outputs, in the order it sent them; ``on_lost``: a replica ended this
    gateway's stream or died, and the gateway's requests there must move (it is not serving by then)."""

    def __init__(self, replicas: list[Replica], client_id: str,
                 on_outputs: Callable[[Replica, list[EngineCoreOutput]], None],
                 on_lost: Callable[[Replica], None]) -> None:
        self.replicas = replicas
        self.client_id = client_id
        self._on_outputs = on_outputs
        self._on_lost = on_lost
        self._listeners: list[Callable[[], Awaitable[None]]] = []
        self._changed = asyncio.Event()  # set (and replaced) whenever a replica's state changes
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._pump(r)) for r in self.replicas] + [loop.create_task(self._renew())]

    def watch(self, r: Replica) -> None:
        """Follow one more replica (already in ``replicas``)."""
        self._tasks.append(asyncio.get_running_loop().create_task(self._pump(r)))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def num_serving(self) -> int:
        return sum(r.serving for r in self.replicas)

    @property
    def healthy(self) -> bool:
        return any(r.serving for r in self.replicas)

    @property
    def detail(self) -> str:
        return health_detail(self.replicas)

    def add_listener(self, listener: Callable[[], Awaitable[None]]) -> None:
        self._listeners.append(listener)

    async def changed(self, timeout: float) -> None:
        """Return when a replica's state changes, or after ``timeout`` seconds."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    async def set_state(self, r: Replica, *, alive: bool | None = None, ready: bool | None = None) -> None:
        if alive is not None:
            r.alive = alive
        if ready is not None:
            r.ready = ready
        self._changed.set()
        self._changed = asyncio.Event()
        for listener in self._listeners:
            await listener()

    async def _renew(self) -> None:
        """Renew this gateway's lease on every replica, never waiting on a slow one."""
        async def renew(r: Replica) -> None:
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

    async def _pump(self, r: Replica) -> None:
        """Receive the replica's outputs; when its actor dies, hand its requests on and wait for Ray to restart it."""
        i = r.index
        while True:
            gen = r.actor.output_stream.options(num_returns="streaming").remote(self.client_id)
            try:
                async for ref in gen:
                    await self.deliver(r, await ref)
                # The replica ended the stream: it is moving its requests out (a scale-in), or it heard no lease
                # renewal from this gateway in time (a stalled event loop); either way it aborted this gateway's
                # requests there. Resume them elsewhere and listen again.
                if r.retiring:
                    logger.info("replica %d is draining; moving its requests to other replicas", i)
                else:
                    logger.warning("replica %d took this gateway for dead; resuming its requests", i)
                self._on_lost(r)
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if r.retiring:
                    logger.info("replica %d ended", i)
                else:
                    logger.error("replica %d failed: %s", i, e)
            await self.set_state(r, alive=False)
            r.cached.clear()  # a restarted engine starts with an empty cache; its snapshot says so on reconnecting
            self._on_lost(r)
            restarted = await self._await_restart(r)
            if restarted is not True:
                if isinstance(restarted, str):
                    r.error = restarted
                else:
                    r.gone = True
                if r.retiring:
                    self.replicas.remove(r)
                    logger.info("replica %d released (%d serving)", i, self.num_serving)
                await self.set_state(r)
                return
            logger.info("replica %d restarted", i)
            r.restarts += 1
            await self.set_state(r, alive=True, ready=True)

    @staticmethod
    async def _await_restart(r: Replica) -> bool | str:
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

    async def deliver(self, r: Replica, batch: list[StreamItem]) -> None:
        """One batch from the replica's stream: its events applied, its outputs handed on."""
        outputs = []
        for item in batch:
            if isinstance(item, KVEventBatch):
                apply_kv_events(r, item)
            elif isinstance(item, KVCacheSnapshot):
                r.cached = set(item.block_hashes)
            elif isinstance(item, EngineHealth):
                await self._health_event(r, item)
            else:
                outputs.append(item)
        self._on_outputs(r, outputs)

    async def _health_event(self, r: Replica, item: EngineHealth) -> None:
        if item.draining:
            if not r.retiring:
                logger.info("replica %d draining: %s", r.index, item.reason)
            r.retiring = True
        elif item.failed:
            logger.error("replica %d failed: its model fails every step the same way: %s; it is no longer routed to",
                         r.index, item.reason)
            r.error = item.reason
        elif not r.retiring:
            logger.log(logging.INFO if item.healthy else logging.WARNING, "replica %d %s", r.index,
                       "serves again" if item.healthy else f"cannot serve: {item.reason}")
        await self.set_state(r, ready=item.healthy and not r.retiring)
