"""What both generation routes share: one HTTP request's place among its tenant's and its admission slot, its
request timer, its engine requests (one per prompt, each owned by the request's API key) merged into one stream of
outputs, and the client's disconnect, which aborts them all."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import ExitStack, aclosing
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TypeVar

from starlette.types import Receive

from pagedserve.cluster.server.openai.errors import OpenAIError, model_not_found
from pagedserve.cluster.server.request_ids import server_request_id
from pagedserve.cluster.server.state import ServingState
from pagedserve.common.outputs import BeamSearchOutput, RequestOutput
from pagedserve.common.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.engine.core_types import DEFAULT_TENANT, EngineCoreRequest
from pagedserve.engine.input_processor import PromptType
from pagedserve.engine.protocol import EngineClient

T = TypeVar("T")
Output = RequestOutput | BeamSearchOutput
# How long a stream's status line waits for the engine to take the request: a full waiting queue gets its 429 well
# within this (one Ray call); a request queued behind others then streams on, headers first.
ADMISSION_WAIT_S = 0.5


@dataclass(frozen=True)
class Caller:
    """Who made an HTTP generation request."""

    key: int | None = None  # the index of the API key it presented (None without keys): whose requests it may abort
    tenant: str = DEFAULT_TENANT.name


ANONYMOUS = Caller()
# Set by the route before the generation task starts (the task copies it), read by GenerationRun, so the serving
# modules need not pass it along.
REQUEST_CALLER: ContextVar[Caller] = ContextVar("pagedserve_request_caller", default=ANONYMOUS)


class ClientDisconnected(Exception):
    """The client closed the connection before the response."""


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, aw: Awaitable[T]) -> T:
    """``aw``'s result, unless the client goes away first: then ``aw`` is cancelled (closing its engine streams,
    which aborts the requests and frees their blocks) and ClientDisconnected is raised."""
    task = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # whatever it ended with, the client is gone
        pass
    raise ClientDisconnected


def served_model(state: ServingState, name: str | None) -> str:
    served = state.model.name
    if name is not None and name != served:
        raise model_not_found(name, served)
    return served


def new_request_id(given: str | None) -> str:
    """The body's ``request_id`` with the server's random suffix (see ``request_ids``); raises InvalidRequestError
    (400) for one that is too long."""
    return server_request_id(given)


@dataclass
class EnginePrompt:
    request_id: str
    text: str | None
    request: EngineCoreRequest

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt_token_ids


def num_new_tokens(out: Output, prompt_len: int) -> int:
    if isinstance(out, BeamSearchOutput):
        return sum(len(b.tokens) - prompt_len for b in out.sequences)
    return sum(len(c.token_ids) for c in out.outputs)


def _first_finish_reason(out: Output) -> str | None:
    if isinstance(out, BeamSearchOutput):
        return out.sequences[0].finish_reason if out.sequences else None
    return next((c.finish_reason for c in out.outputs if c.finish_reason), None)


async def _merge(streams: list[AsyncIterator[Output]]) -> AsyncGenerator[tuple[int, Output], None]:
    """(prompt index, output) from every engine stream as they come; closing this closes them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as s:
            async for out in s:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Output]) -> None:
        try:
            async with aclosing(stream) as s:
                async for out in s:
                    queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))
        except Exception as e:
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:  # a pump cancelled before it started never opened its stream
            await s.aclose()


class GenerationRun:
    """One HTTP generation request. Made first, it takes a place among its tenant's requests (OverloadedError at the
    tenant's limit: nothing taken, nothing to close). ``close()`` (always called, once, from then on) aborts what
    still runs, releases the admission slot and the tenant's place and ends the request's metrics: finished, or
    "abort" (client gone) / "error"."""

    def __init__(self, state: ServingState) -> None:
        caller = REQUEST_CALLER.get()
        self.ticket = state.tenants.admit(caller.tenant)
        self.state = state
        self.timer = state.metrics.request("http")
        self.timer.tenant(self.ticket.label)
        self.prompts: list[EnginePrompt] = []
        self.admitted = False
        self.finished = False
        self.failed = False
        self._slot = ExitStack()
        self._outputs: AsyncGenerator[tuple[int, Output], None] | None = None
        self._first: asyncio.Future | None = None
        self._closed = False
        self.owner = caller.key
        self.session_id: str | None = None  # the x-session-id header or the ``user`` field: routing affinity

    def admit(self, num_prompts: int, params: SamplingParams | BeamSearchParams) -> None:
        """Takes a slot per engine sequence (prompts x best_of, or x the beam width); raises OverloadedError past
        --max-concurrent-requests."""
        per_prompt = params.beam_width if isinstance(params, BeamSearchParams) else params.best_of
        self._slot.enter_context(self.state.request_slot(num_prompts * per_prompt))

    async def add(self, engine: EngineClient, request_id: str, prompt: PromptType,
                  params: SamplingParams | BeamSearchParams, cache_salt: str | None, priority: int = 0) -> EnginePrompt:
        text, request = await engine.process(request_id, prompt, params, cache_salt, priority, self.ticket.tenant)
        self.prompts.append(EnginePrompt(request_id, text, request))
        self.state.owners.add(request_id, self.owner)  # released by close()
        return self.prompts[-1]

    def outputs(self, engine: EngineClient, stream: bool) -> AsyncGenerator[tuple[int, Output], None]:
        self._outputs = self._run(engine, stream)
        return self._outputs

    async def _run(self, engine: EngineClient, stream: bool) -> AsyncGenerator[tuple[int, Output], None]:
        streams = [engine.generate(p.text, p.request, stream, self.session_id, self.ticket.started)
                   for p in self.prompts]
        lens = [len(p.token_ids) for p in self.prompts]
        remaining, reason = len(streams), None
        async with aclosing(_merge(streams)) as merged:
            async for i, out in merged:
                if not self.admitted:
                    self.admitted = True
                    limit = engine.info.max_model_len  # max_tokens None: up to the model's length
                    self.timer.admitted(sum(lens), sum(p.request.sampling_params.max_tokens or limit - n
                                                       for p, n in zip(self.prompts, lens)))
                self.timer.tokens(num_new_tokens(out, lens[i]))
                if out.finished:
                    remaining -= 1
                    reason = reason or _first_finish_reason(out)
                    if remaining == 0:
                        self.finished = True
                        self.timer.finished(reason or "stop")
                yield i, out

    async def first_output(self, wait: float) -> asyncio.Future:
        """Start on the first output and give it ``wait`` seconds: a refusal (a full waiting queue, a failed
        replica) that comes within them still gets its status code. A request that is queued meanwhile streams on,
        headers first; its first chunk comes when it is scheduled."""
        self._first = asyncio.ensure_future(anext(self._outputs))
        await asyncio.wait((self._first,), timeout=wait)
        if self._first.done():
            self._first.result()  # raises the refusal
        return self._first

    def fail(self, err: OpenAIError) -> None:
        """An error after the response began (it goes out in the stream)."""
        self.failed = True
        self.timer.error(err.grpc_code)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._first is not None and not self._first.done():
                self._first.cancel()  # it runs the output generator, which cannot be closed while it does
                await asyncio.gather(self._first, return_exceptions=True)
            if self._outputs is not None:
                await self._outputs.aclose()
        finally:
            self._slot.close()
            self.ticket.release()
            for p in self.prompts:
                self.state.owners.discard(p.request_id)
            if self.admitted and not self.finished:
                self.timer.finished("error" if self.failed else "abort")
