"""The replicas a server runs, changed while it serves: scale out (place, warm up, then route) and scale in (stop
routing, let requests finish, move the rest, release). Owned by the process that launched the replicas.

Scale-in moves requests with the machinery that resumes them after a replica dies: the replica ends every gateway's
output stream, each gateway resumes its requests there on another replica with the tokens streamed so far and the
same seed, so greedy and seeded streams continue exactly.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging

import ray

from pagedserve.cluster.runtime.replicas import Replica, ReplicaRole, launch_replica, shutdown_replicas
from pagedserve.cluster.runtime.router import ReplicaRouter
from pagedserve.common.errors import EngineUnavailableError, InvalidRequestError
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.core_types import ScaleResult
from pagedserve.engine.executor.ray_utils import HELD_CHECK_S
from pagedserve.engine.protocol import ReplicaScaler

logger = logging.getLogger(__name__)

MAX_REPLICAS = 256
DRAIN_POLL_S = 0.2


class ReplicaSet(ReplicaScaler):
    """``router``: the in-process gateway's router, told of each replica added (one it drains learns of the drain
    from the replica itself). The two share each ``Replica`` record; each keeps its own list."""

    def __init__(self, args: EngineArgs, replicas: list[Replica], router: ReplicaRouter, drain_timeout: float,
                 max_waiting_requests: int | None = None, step_timeout: float | None = None,
                 name: str | None = None) -> None:
        self.args = args
        self.replicas = list(replicas)
        self.router = router
        self.drain_timeout = drain_timeout
        self.max_waiting_requests = max_waiting_requests
        self.step_timeout = step_timeout
        self.name = name
        self._next_index = max((r.index for r in replicas), default=-1) + 1
        self._lock = asyncio.Lock()

    @property
    def is_scaling(self) -> bool:
        return self._lock.locked()

    async def scale_to(self, num_replicas: int, drain_timeout: float | None = None,
                       pool: str | None = None) -> ScaleResult:
        role = self._role(pool)
        least = 0 if role == ReplicaRole.PREFILL else 1
        if not least <= num_replicas <= MAX_REPLICAS:
            raise InvalidRequestError(f"the number of {role.value} replicas must be between {least} and "
                                      f"{MAX_REPLICAS}, got {num_replicas}")
        if self._lock.locked():
            raise InvalidRequestError("a scaling operation is already in progress; retry when it ends")
        async with self._lock:
            members = [r for r in self.replicas if r.role == role]
            current = len(members)
            share = len(self.replicas) - current + num_replicas
            if num_replicas > current:
                for _ in range(num_replicas - current):
                    await self._add(share, held_wait_s=None, role=role)
                return ScaleResult(len(self.replicas), num_replicas - current, 0, 0)
            if num_replicas < current:
                victims = await self._least_busy(members, current - num_replicas)
                moved = await asyncio.gather(*[self._remove(r, drain_timeout, "scaled in") for r in victims])
                return ScaleResult(len(self.replicas), 0, len(victims), sum(moved))
            return ScaleResult(len(self.replicas), 0, 0, 0)

    def _role(self, pool: str | None) -> ReplicaRole:
        """The role of the replicas ``pool`` names; None: the replicas that decode."""
        disaggregated = any(r.role != ReplicaRole.BOTH for r in self.replicas)
        if pool is None:
            return ReplicaRole.DECODE if disaggregated else ReplicaRole.BOTH
        if not disaggregated or pool not in (ReplicaRole.PREFILL.value, ReplicaRole.DECODE.value):
            raise InvalidRequestError(f"pool {pool!r}: only a server started with --prefill-replicas has pools, "
                                      "named prefill and decode")
        return ReplicaRole(pool)

    async def rollout(self, model: str, drain_timeout: float | None = None) -> ScaleResult:
        new_args = dataclasses.replace(self.args, model=model)
        try:
            new_args.create_engine_config()  # a bad dir or TP split fails before anything changes
        except ValueError as e:
            raise InvalidRequestError(f"model: {e}") from None
        if self._lock.locked():
            raise InvalidRequestError("a scaling operation is already in progress; retry when it ends")
        async with self._lock:
            old = list(self.replicas)
            moved = 0
            for i, r in enumerate(old):
                logger.info("rollout: replacing replica %d (%d of %d) with one serving %s", r.index, i + 1,
                            len(old), model)
                try:  # surge: the new one first, where the cluster has room for it now
                    await self._add(len(self.replicas) + 1, new_args, held_wait_s=0, role=r.role)
                    moved += await self._remove(r, drain_timeout, "replaced by a rollout")
                except RuntimeError as e:  # no room for one more: drain this one, then put the new one in its place
                    logger.info("rollout: no room to surge (%s); replacing in place", e)
                    moved += await self._remove(r, drain_timeout, "replaced by a rollout")
                    try:
                        await self._add(len(self.replicas) + 1, new_args, role=r.role)
                    except (EngineUnavailableError, RuntimeError, ValueError):  # ValueError: its preflight
                        await self._add(len(self.replicas) + 1, self.args, role=r.role)  # the old model back
                        raise
            self.args = new_args
            logger.info("rollout: every replica serves %s", model)
            return ScaleResult(len(self.replicas), len(old), len(old), moved, model)

    async def _add(self, share: int, args: EngineArgs | None = None,
                   held_wait_s: float | None = HELD_CHECK_S, role: ReplicaRole = ReplicaRole.BOTH) -> None:
        index = self._next_index
        self._next_index += 1
        logger.info("placing replica %d (%s)", index, role.value)
        replica = await asyncio.to_thread(launch_replica, args or self.args, index, share,
                                          self.max_waiting_requests, self.step_timeout, self.name, held_wait_s, role)
        self.replicas.append(replica)
        await self.router.add_replica(replica)

    @staticmethod
    async def _least_busy(replicas: list[Replica], n: int) -> list[Replica]:
        async def owned(r: Replica) -> int:
            try:
                return await r.actor.num_owned_requests.remote()
            except ray.exceptions.RayError:  # dead or restarting: the cheapest to let go
                return -1

        counts = await asyncio.gather(*[owned(r) for r in replicas])
        order = sorted(range(len(replicas)), key=lambda i: (counts[i], -replicas[i].index))
        return [replicas[i] for i in order[:n]]

    async def _remove(self, r: Replica, drain_timeout: float | None, reason: str) -> int:
        """Drain, move what is left, release; returns the requests moved."""
        timeout = self.drain_timeout if drain_timeout is None else drain_timeout
        self.replicas.remove(r)
        moved = 0
        try:
            await r.actor.begin_drain.remote(reason)
            logger.info("replica %d draining, %s (up to %.0f s)", r.index, reason, timeout)
            deadline = asyncio.get_running_loop().time() + timeout
            while await r.actor.num_owned_requests.remote() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
            moved = await r.actor.migrate_out.remote()
            if moved:
                logger.info("moving %d request(s) off replica %d", moved, r.index)
            # The gateways abort their requests there as their streams end; wait for that before the actor goes.
            while await r.actor.num_owned_requests.remote() and asyncio.get_running_loop().time() < deadline + 10:
                await asyncio.sleep(DRAIN_POLL_S)
        except ray.exceptions.RayError as e:  # it died meanwhile: the gateways resume its requests anyway
            logger.warning("replica %d failed while draining: %s", r.index, e)
        finally:
            # Also when the scaling is cancelled (the server stopping its autoscaler): out of self.replicas, nothing
            # else would release the replica or its placement group.
            await asyncio.shield(asyncio.to_thread(shutdown_replicas, [r]))
            logger.info("replica %d released", r.index)
        return moved

    async def shutdown(self) -> None:
        async with self._lock:
            await asyncio.to_thread(shutdown_replicas, self.replicas)
            self.replicas = []
