"""The router over a serving cluster's replicas (the gateway's ``EngineClient``): processes each request once, sends
it to the replica ``routing`` picks, receives every replica's outputs (``replica_health``), moves a request whose
engine died or let it go (``resumption``), and turns token ids into text with an ``OutputProcessor``."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

from prometheus_client.core import Metric

from pagedserve.cluster.runtime.handoff import DisaggConfig, Disaggregation, prefill_request
from pagedserve.cluster.runtime.replica_health import ReplicaHealth
from pagedserve.cluster.runtime.replicas import Replica
from pagedserve.cluster.runtime.resumption import InFlight, Resumption
from pagedserve.cluster.runtime.router_metrics import collect_metrics
from pagedserve.cluster.runtime.routing import DECODE_ESTIMATE_CAP, LeastLoaded, ReplicaPicker, RoutingPolicy
from pagedserve.common.errors import EngineUnavailableError, InvalidRequestError
from pagedserve.common.outputs import BeamSearchOutput, EngineCoreOutput, RequestOutput
from pagedserve.common.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.engine.core_types import DEFAULT_TENANT, EngineCoreRequest, EngineInfo, EngineStats, Tenant
from pagedserve.engine.input_processor import InputProcessor, PromptType
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.protocol import EngineClient

logger = logging.getLogger(__name__)

INLINE_TOKENIZE_CHARS = 16_384  # longer text prompts are tokenized on a worker thread
MAX_TTFT_SAMPLES = 10_000


class ReplicaRouter(EngineClient):
    """``infos``: each replica's ``EngineInfo``; requests are validated against the smallest KV pool.

    When a replica's engine-core actor dies, its requests are resumed rather than failed (see ``resumption``).
    """

    def __init__(self, replicas: list[Replica], tokenizer, infos: list[EngineInfo],
                 policy: RoutingPolicy | None = None, disagg: DisaggConfig | None = None) -> None:
        self.replicas = list(replicas)
        self.info = dataclasses.replace(infos[0], num_kv_blocks=min(i.num_kv_blocks for i in infos))
        self.input_processor = InputProcessor(tokenizer, self.info)
        self.processor = OutputProcessor(tokenizer, self._stop_sequence, self.info.stream_interval)
        self.inflight: dict[str, InFlight] = {}
        self.picker = ReplicaPicker(self.replicas, policy or LeastLoaded(), self.info.block_size)
        self.health = ReplicaHealth(self.replicas, uuid.uuid4().hex, self._on_outputs, self._on_lost)
        self.resumption = Resumption(self.health, self.picker, self.processor, self.inflight)
        # With a prefill pool, long prompts are prefilled there and handed to the decode pool (``handoff``).
        self.disagg = Disaggregation(disagg or DisaggConfig(), self.replicas, self.info.block_size, self.picker,
                                     self.resumption, self.inflight)
        self._ttfts: deque[float] = deque(maxlen=MAX_TTFT_SAMPLES)  # seconds to first output, since last taken
        # More families for /metrics: the handoffs' (zero without a prefill pool), the autoscaler's.
        self.metric_sources: list[Callable[[], list[Metric]]] = [self.disagg.collect_metrics]

    def start(self) -> None:
        self.health.start()

    async def add_replica(self, replica: Replica) -> None:
        """Route to one more (warmed-up) replica: a scale-out, or a replacement during a rollout."""
        if any(r.index == replica.index for r in self.replicas):
            return
        self.replicas.append(replica)
        self.health.watch(replica)
        logger.info("replica %d added (%d serving)", replica.index, self.num_replicas)
        await self.health.set_state(replica)

    def take_ttfts(self) -> list[float]:
        """Times to first output of the requests that started since the last call (the autoscaler's TTFT)."""
        out = list(self._ttfts)
        self._ttfts.clear()
        return out

    @property
    def num_replicas(self) -> int:
        return self.health.num_serving

    @property
    def num_running(self) -> int:
        return len(self.inflight)

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    @property
    def health_detail(self) -> str:
        """Why no replica serves (each replica's state, with the error of one whose model failed)."""
        return self.health.detail

    def add_health_listener(self, listener: Callable[[], Awaitable[None]]) -> None:
        self.health.add_listener(listener)

    def _stop_sequence(self, request_id: str, index: int) -> None:
        rec = self.inflight.get(request_id)
        if rec is not None:
            rec.replica.actor.stop_sequence.remote(request_id, index)

    def _on_outputs(self, r: Replica, items: list[EngineCoreOutput]) -> None:
        outputs = []
        for item in items:
            rec = self.inflight.get(item.request_id)
            if rec is not None and rec.replica is not r:  # sent before the request moved: stale
                continue
            if rec is not None and rec.decode_request is not None and item.finish_reasons:
                item = self.disagg.intercept(rec, r, item)
                if item is None:
                    continue
            outputs.append(item)
            if rec is None:
                continue
            if item.error is not None:
                rec.error, rec.invalid = item.error, item.invalid_request
            elif rec.on_first_output is not None and (item.new_token_ids or item.finished):
                first, rec.on_first_output = rec.on_first_output, None
                first()
        for out in self.processor.process(outputs):
            rec = self.inflight.get(out.request_id)
            if rec is not None:
                rec.queue.put_nowait(out)

    def _on_lost(self, r: Replica) -> None:
        self.resumption.resume_all(r)

    # ---- the EngineClient API ----------------------------------------------------------------------------------
    async def process(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams | None,
                      cache_salt: str | None = None, priority: int = 0, tenant: Tenant = DEFAULT_TENANT
                      ) -> tuple[str | None, EngineCoreRequest]:
        if request_id in self.inflight:
            raise InvalidRequestError(f"request_id {request_id!r} is already running")
        constrained = isinstance(params, SamplingParams) and params.structured_outputs is not None
        if constrained or (isinstance(prompt, str) and len(prompt) > INLINE_TOKENIZE_CHARS):
            # Long prompts are tokenized, and grammars checked, off the event loop, which streams every other
            # request meanwhile.
            return await asyncio.to_thread(self.input_processor.process, request_id, prompt, params, cache_salt,
                                           priority, tenant)
        return self.input_processor.process(request_id, prompt, params, cache_salt, priority, tenant)

    async def generate(self, prompt: str | None, request: EngineCoreRequest, stream: bool = True,
                       session_id: str | None = None, on_first_output: Callable[[], None] | None = None
                       ) -> AsyncIterator[RequestOutput | BeamSearchOutput]:
        request_id = request.request_id
        if request_id in self.inflight:
            raise InvalidRequestError(f"request_id {request_id!r} is already running")
        pick = self.picker.route(request, session_id)
        prefill = self.disagg.plan(request, pick) if self.disagg.enabled else None
        max_tokens = request.sampling_params.max_tokens or DECODE_ESTIMATE_CAP
        rec = InFlight(request if prefill is None else prefill_request(request), asyncio.Queue(),
                       prefill or pick.replica, prefill=len(request.prompt_token_ids) - pick.num_cached_tokens,
                       decode=min(max_tokens, DECODE_ESTIMATE_CAP), on_first_output=on_first_output,
                       decode_target=pick.replica if prefill is not None else None,
                       decode_request=request if prefill is not None else None)
        self.inflight[request_id] = rec
        rec.replica.load += 1
        rec.charge(rec.replica)
        finished = False
        started = asyncio.get_running_loop().time()
        first = True
        try:
            self.processor.add_request(request_id, prompt, request.prompt_token_ids, request.params, stream,
                                       delta=True)
            await self.resumption.send(rec, session_id)
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
            self.inflight.pop(request_id, None)
            rec.replica.load -= 1
            rec.release()
            self.processor.abort(request_id)
            if not finished and not rec.refused and rec.replica.alive:
                rec.replica.actor.abort.remote([request_id])

    async def abort(self, request_id: str) -> bool:
        """End a running request: its stream ends with finish reason "abort"."""
        rec = self.inflight.get(request_id)
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
        """Every live replica's metric families, their samples labelled ``replica``, and the router's own."""
        return collect_metrics(self.replicas, self.info.tensor_parallel_size, self.picker, self.num_replicas,
                               self.metric_sources)

    async def close(self) -> None:
        await self.health.close()
