"""The router over a serving cluster's replicas (the gateway's ``EngineClient``): processes each request once,
picks the replica with the fewest running requests, receives every replica's output stream (one Ray streaming
generator each) and turns token ids into text with an ``OutputProcessor``."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import ray
from prometheus_client.core import GaugeMetricFamily, Metric

from pagedserve.cluster.runtime.replicas import Replica
from pagedserve.engine.core_types import EngineCoreRequest, EngineInfo, EngineStats
from pagedserve.engine.input_processor import InputProcessor, PromptType
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.protocol import EngineClient
from pagedserve.errors import EngineUnavailableError, InvalidRequestError, OverloadedError
from pagedserve.outputs import BeamSearchOutput, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0
INLINE_TOKENIZE_CHARS = 16_384  # longer text prompts are tokenized on a worker thread


def unwrap(e: BaseException) -> BaseException:
    """The user's exception inside a Ray task error (ValueError, OverloadedError, ...)."""
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(getattr(e, "cause", None), BaseException):
        return e.cause
    return e


class ReplicaRouter(EngineClient):
    """``infos``: each replica's ``EngineInfo``; requests are validated against the smallest KV pool."""

    def __init__(self, replicas: list[Replica], tokenizer, infos: list[EngineInfo]) -> None:
        self.replicas = replicas
        self.info = dataclasses.replace(infos[0], num_kv_blocks=min(i.num_kv_blocks for i in infos))
        self.client_id = uuid.uuid4().hex
        self.input_processor = InputProcessor(tokenizer, self.info)
        self.processor = OutputProcessor(tokenizer, self._stop_sequence)
        self._queues: dict[str, asyncio.Queue] = {}
        self._replica_of: dict[str, int] = {}
        self.load = [0] * len(replicas)  # running requests per replica, from this gateway
        self.alive = [True] * len(replicas)
        self._pumps: list[asyncio.Task] = []
        self._health_listeners: list[Callable[[], Awaitable[None]]] = []

    def start(self) -> None:
        self._pumps = [asyncio.get_running_loop().create_task(self._pump(r)) for r in self.replicas]

    @property
    def num_running(self) -> int:
        return len(self._queues)

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
            await self._set_alive(replica.index, False)
            err = EngineUnavailableError(f"model replica {replica.index} failed; retry the request")
            for rid, i in list(self._replica_of.items()):
                if i == replica.index:
                    self._queues[rid].put_nowait(err)
            if not await self._await_restart(replica):
                return
            logger.info("replica %d restarted", replica.index)
            await self._set_alive(replica.index, True)

    @property
    def healthy(self) -> bool:
        return any(self.alive)

    def add_health_listener(self, listener: Callable[[], Awaitable[None]]) -> None:
        self._health_listeners.append(listener)

    async def _set_alive(self, index: int, alive: bool) -> None:
        self.alive[index] = alive
        for listener in self._health_listeners:
            await listener()

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

    async def process(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams | None,
                      cache_salt: str | None = None) -> tuple[str | None, EngineCoreRequest]:
        if request_id in self._queues:
            raise InvalidRequestError(f"request_id {request_id!r} is already running")
        if isinstance(prompt, str) and len(prompt) > INLINE_TOKENIZE_CHARS:
            # ~0.75 us a character here (16 kB inline: ~12 ms); longer ones off the event loop, which streams every
            # other request meanwhile.
            return await asyncio.to_thread(self.input_processor.process, request_id, prompt, params, cache_salt)
        return self.input_processor.process(request_id, prompt, params, cache_salt)

    async def generate(self, prompt: str | None, request: EngineCoreRequest,
                       stream: bool = True) -> AsyncIterator[RequestOutput | BeamSearchOutput]:
        request_id = request.request_id
        if request_id in self._queues:
            raise InvalidRequestError(f"request_id {request_id!r} is already running")
        i = self._pick()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._replica_of[request_id] = i
        self.load[i] += 1
        finished = False
        try:
            self.processor.add_request(request_id, prompt, request.prompt_token_ids, request.params, stream,
                                       delta=True)
            try:
                await self.replicas[i].actor.add_request.remote(self.client_id, request)
            except ray.exceptions.RayTaskError as e:
                cause = unwrap(e)
                if isinstance(cause, (ValueError, OverloadedError)):
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

    async def get_stats(self) -> list[EngineStats]:
        return await asyncio.gather(*[r.actor.get_stats.remote() for r, ok in zip(self.replicas, self.alive) if ok])

    def collect_metrics(self) -> list[Metric]:
        """Every live replica's metric families, their samples labelled ``replica``, and the workers-up gauges."""
        tp = self.info.tensor_parallel_size
        up = GaugeMetricFamily("pagedserve_workers_up", "Model workers (TP ranks) alive, per replica.",
                               labels=["replica"])
        expected = GaugeMetricFamily("pagedserve_workers_expected",
                                     "Model workers (TP ranks) configured, per replica.", labels=["replica"])
        merged: dict[str, Metric] = {}
        for r, alive in zip(self.replicas, self.alive):
            label = str(r.index)
            expected.add_metric([label], tp)
            families = None
            if alive:
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
        return [up, expected, *merged.values()]

    async def close(self) -> None:
        for t in self._pumps:
            t.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
