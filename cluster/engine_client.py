"""The gateway's side of the scheduler actors: picks a replica per request, receives every replica's output
stream (one Ray streaming generator each) and turns token ids into text with an ``OutputProcessor``."""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import ray

from pagedserve.cluster.replicas import Replica
from pagedserve.cluster.scheduler_actor import QueueFullError
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.outputs import BeamSearchOutput, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)


class EngineUnavailableError(RuntimeError):
    """The replica serving a request failed (its actor died, or its workers did mid-request)."""


def unwrap(e: BaseException) -> BaseException:
    """The user's exception inside a Ray task error (ValueError, QueueFullError, ...)."""
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(getattr(e, "cause", None), BaseException):
        return e.cause
    return e


class EngineClient:
    def __init__(self, replicas: list[Replica], tokenizer, tensor_parallel_size: int = 1) -> None:
        self.replicas = replicas
        self.tensor_parallel_size = tensor_parallel_size
        self.client_id = uuid.uuid4().hex
        self.processor = OutputProcessor(tokenizer, self._stop_sequence)
        self._queues: dict[str, asyncio.Queue] = {}
        self._replica_of: dict[str, int] = {}
        self.load = [0] * len(replicas)  # running requests per replica, from this gateway
        self.alive = [True] * len(replicas)
        self._pumps: list[asyncio.Task] = []

    def start(self) -> None:
        self._pumps = [asyncio.get_running_loop().create_task(self._pump(r)) for r in self.replicas]

    @property
    def num_running(self) -> int:
        return len(self._queues)

    def is_running(self, request_id: str) -> bool:
        return request_id in self._queues

    def _stop_sequence(self, request_id: str, index: int) -> None:
        i = self._replica_of.get(request_id)
        if i is not None:
            self.replicas[i].actor.stop_sequence.remote(request_id, index)

    async def _pump(self, replica: Replica) -> None:
        """Receive the replica's outputs; when its actor dies, fail its requests and wait for Ray to restart it."""
        while True:
            gen = replica.actor.output_stream.options(num_returns="streaming").remote(self.client_id)
            try:
                async for ref in gen:
                    self._deliver(await ref)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.error("replica %d failed: %s", replica.index, e)
            self.alive[replica.index] = False
            err = EngineUnavailableError(f"model replica {replica.index} failed; retry the request")
            for rid, i in list(self._replica_of.items()):
                if i == replica.index:
                    self._queues[rid].put_nowait(err)
            if not await self._await_restart(replica):
                return
            logger.info("replica %d restarted", replica.index)
            self.alive[replica.index] = True

    @staticmethod
    async def _await_restart(replica: Replica) -> bool:
        """Wait for Ray to restart the actor (``max_restarts``); False once it is dead for good."""
        while True:
            try:
                await replica.actor.warmup.remote()
                return True
            except ray.exceptions.ActorUnavailableError:  # restarting
                await asyncio.sleep(0.5)
            except ray.exceptions.RayActorError as e:
                logger.error("replica %d is gone for good: %s", replica.index, e)
                return False

    def _deliver(self, batch) -> None:
        for out in self.processor.process(batch):
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _pick(self) -> int:
        live = [i for i, ok in enumerate(self.alive) if ok]
        if not live:
            raise EngineUnavailableError("no model replica is available")
        return min(live, key=lambda i: self.load[i])

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams | BeamSearchParams, stream: bool = True,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput | BeamSearchOutput]:
        """Yield the request's delta outputs (each step's when ``stream``, else the final one). Raises ValueError,
        QueueFullError or EngineUnavailableError; cancelling the iteration aborts the request."""
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already running")
        i = self._pick()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._replica_of[request_id] = i
        self.load[i] += 1
        finished = False
        try:
            self.processor.add_request(request_id, prompt, prompt_token_ids, params, stream, delta=True)
            try:
                await self.replicas[i].actor.add_request.remote(self.client_id, request_id, prompt_token_ids, params,
                                                                 cache_salt)
            except ray.exceptions.RayTaskError as e:
                cause = unwrap(e)
                if isinstance(cause, (ValueError, QueueFullError)):
                    finished = True  # nothing was queued
                    raise cause from None
                raise EngineUnavailableError(f"model replica {i} failed: {type(cause).__name__}") from None
            except ray.exceptions.RayError as e:
                raise EngineUnavailableError(f"model replica {i} is unavailable: {type(e).__name__}") from None
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, RequestOutput) and any(c.finish_reason == "error" for c in item.outputs):
                    finished = True
                    raise EngineUnavailableError("the model workers failed while this request ran; retry it")
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            self._replica_of.pop(request_id, None)
            self.load[i] -= 1
            self.processor.abort(request_id)
            if not finished and self.alive[i]:
                self.replicas[i].actor.abort.remote([request_id])

    async def abort(self, request_id: str) -> bool:
        """End a running request: its stream ends with finish reason "abort"."""
        i = self._replica_of.get(request_id)
        if i is None:
            return False
        out = self.processor.abort_output(request_id)
        await self.replicas[i].actor.abort.remote([request_id])
        q = self._queues.get(request_id)
        if q is not None and out is not None:
            q.put_nowait(out)
        return True

    async def stats(self) -> list[dict]:
        return await asyncio.gather(*[r.actor.get_stats.remote() for r, ok in zip(self.replicas, self.alive) if ok])

    async def close(self) -> None:
        for t in self._pumps:
            t.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
