"""``POST /v1/completions``: prompts in, choices out (``n`` per prompt, choice index = prompt * n + completion),
whole or streamed as server-sent events."""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from starlette.responses import Response

from pagedserve.cluster.server.openai.completion_protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
)
from pagedserve.cluster.server.openai.generation import (
    ADMISSION_WAIT_S,
    EnginePrompt,
    GenerationRun,
    Output,
    new_request_id,
    served_model,
)
from pagedserve.cluster.server.openai.logprobs import CompletionLogprobsBuilder, prompt_logprobs_json
from pagedserve.cluster.server.openai.protocol import usage
from pagedserve.cluster.server.openai.sampling import build_params
from pagedserve.cluster.server.openai.sse import EventStreamResponse, sse_events
from pagedserve.cluster.server.state import ServingState
from pagedserve.common.outputs import BeamSearchOutput, CompletionOutput, Logprob

FIELDS = set(CompletionRequest.model_fields)


def _prompts(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], list):
        return list(prompt)
    if prompt and isinstance(prompt[0], str):
        return list(prompt)
    return [prompt]  # token ids (or an empty list, which the engine refuses naming the prompt)


@dataclass
class _Choice:
    """One choice's text and tokens so far, and what of it went out."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False  # streamed: its first chunk (with the echo) went out
    builder: CompletionLogprobsBuilder | None = None


@dataclass
class _Prompt:
    prompt: EnginePrompt
    choices: dict[int, _Choice] = field(default_factory=dict)
    prompt_logprobs: list = field(default_factory=list)
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    beams: BeamSearchOutput | None = None


class CompletionServing:
    def __init__(self, state: ServingState) -> None:
        self.state = state

    async def create(self, req: CompletionRequest, session_id: str | None = None) -> Response:
        engine = self.state.ready_engine()
        model = served_model(self.state, req.model)
        prompts = _prompts(req.prompt)
        plp = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            plp = max(plp or 0, req.logprobs)  # the echoed prompt's logprobs
        params = build_params(req, req.max_tokens, req.logprobs, plp, req.best_of)
        rid = new_request_id(req.request_id)
        run = GenerationRun(self.state)
        run.session_id = session_id or req.user
        handed_off = False
        try:
            run.admit(len(prompts), params)
            for i, p in enumerate(prompts):
                await run.add(engine, rid if len(prompts) == 1 else f"{rid}-{i}", p, params, req.cache_salt,
                              req.priority)
            completion = _Completion(self, req, model, rid, run)
            outputs = run.outputs(engine, stream=req.stream and not req.use_beam_search)
            if not req.stream:
                async for i, out in outputs:
                    completion.add(i, out)
                return Response(completion.response().model_dump_json(), media_type="application/json")
            first = await run.first_output(ADMISSION_WAIT_S)
            handed_off = True
            return EventStreamResponse(sse_events(completion.stream(first, outputs), run.fail, FIELDS), run.close)
        except BaseException as e:
            run.failed = isinstance(e, Exception)
            raise
        finally:
            if not handed_off:
                await run.close()


class _Completion:
    """The choices of one completions request, folded from delta outputs (whole response) or turned into
    chunks as they come (stream)."""

    def __init__(self, serving: CompletionServing, req: CompletionRequest, model: str, rid: str,
                 run: GenerationRun) -> None:
        self.tokenizer = serving.state.tokenizer
        self.req = req
        self.model = model
        self.id = f"cmpl-{rid}"
        self.prompts = [_Prompt(p) for p in run.prompts]
        self.cached_details = serving.state.options.prompt_tokens_details
        self.k = req.logprobs

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _prompt_text(self, p: _Prompt) -> str:
        if p.prompt.text is not None:
            return p.prompt.text
        return self.tokenizer.decode(p.prompt.token_ids, skip_special_tokens=False)

    def add(self, i: int, out: Output) -> list[tuple[int, CompletionOutput, _Choice]]:
        """Fold one output in; returns the choices it moved: (index, the new part, the choice so far)."""
        p = self.prompts[i]
        if isinstance(out, BeamSearchOutput):
            p.beams = out
            return []
        if out.prompt_logprobs:
            p.prompt_logprobs.extend(out.prompt_logprobs)
        if out.finished:
            p.num_cached_tokens = out.num_cached_tokens
        moved = []
        for c in out.outputs:
            ch = p.choices.setdefault(c.index, _Choice())
            ch.text.append(c.text)
            ch.token_ids.extend(c.token_ids)
            if c.logprobs:
                ch.logprobs.extend(c.logprobs)
            p.num_output_tokens += len(c.token_ids)
            if c.finish_reason is not None:
                ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
            if c.text or c.token_ids or c.finish_reason is not None:
                moved.append((c.index, c, ch))
        return moved

    def _echo(self, p: _Prompt) -> tuple[str, list[int], list]:
        """The echoed prompt: its text, token ids and logprob entries (None first)."""
        if not self.req.echo:
            return "", [], []
        return self._prompt_text(p), list(p.prompt.token_ids), p.prompt_logprobs

    def _choice(self, i: int, j: int, text: str, token_ids: list[int], logprobs: CompletionLogProbs | None,
                finish_reason: str | None, stop_reason, first: bool) -> CompletionChoice:
        p = self.prompts[i]
        return CompletionChoice(
            index=i * self.req.n + j, text=text, logprobs=logprobs, finish_reason=finish_reason,
            stop_reason=stop_reason, token_ids=token_ids if self.req.return_token_ids else None,
            prompt_token_ids=list(p.prompt.token_ids) if self.req.return_token_ids and first else None,
            prompt_logprobs=prompt_logprobs_json(p.prompt_logprobs)
            if self.req.prompt_logprobs is not None and first else None)

    def _beam_choices(self, i: int) -> list[CompletionChoice]:
        p = self.prompts[i]
        echo = self._prompt_text(p) if self.req.echo else ""
        n_prompt = len(p.prompt.token_ids)
        return [self._choice(i, j, echo + (b.text or ""), b.tokens[n_prompt:], None, b.finish_reason, None, True)
                for j, b in enumerate(p.beams.sequences[:self.req.n])]

    def _usage(self):
        prompt = sum(len(p.prompt.token_ids) for p in self.prompts)
        completion = sum(p.num_output_tokens if p.beams is None else
                         sum(len(b.tokens) - len(p.prompt.token_ids) for b in p.beams.sequences[:self.req.n])
                         for p in self.prompts)
        cached = sum(p.num_cached_tokens for p in self.prompts)
        return usage(prompt, completion, cached if self.cached_details else None)

    def response(self) -> CompletionResponse:
        choices = []
        for i, p in enumerate(self.prompts):
            if p.beams is not None:
                choices += self._beam_choices(i)
                continue
            echo_text, echo_ids, echo_lps = self._echo(p)
            for j in sorted(p.choices):
                ch = p.choices[j]
                lps = None
                if self.k is not None:
                    builder = CompletionLogprobsBuilder(self.k, self._decode_one)
                    lps = builder.build(echo_ids + ch.token_ids, echo_lps + ch.logprobs)
                choices.append(self._choice(i, j, echo_text + "".join(ch.text), ch.token_ids, lps, ch.finish_reason,
                                            ch.stop_reason, True))
        return CompletionResponse(id=self.id, model=self.model, choices=choices, usage=self._usage())

    async def stream(self, first: Awaitable[tuple[int, Output]],
                     rest: AsyncIterator[tuple[int, Output]]) -> AsyncIterator[list[CompletionResponse]]:
        yield self._chunks(*await first)
        async for i, out in rest:
            yield self._chunks(i, out)
        so = self.req.stream_options
        if so is not None and so.include_usage:
            yield [CompletionResponse(id=self.id, model=self.model, choices=[], usage=self._usage())]

    def _chunks(self, i: int, out: Output) -> list[CompletionResponse]:
        moved = self.add(i, out)
        if isinstance(out, BeamSearchOutput):
            return [CompletionResponse(id=self.id, model=self.model, choices=[c]) for c in self._beam_choices(i)]
        p = self.prompts[i]
        chunks = []
        for j, c, ch in moved:
            first = not ch.started
            text, ids, entries = c.text, c.token_ids, c.logprobs or []
            if first:
                ch.started = True
                echo_text, echo_ids, echo_lps = self._echo(p)
                text, ids, entries = echo_text + text, echo_ids + ids, echo_lps + entries
                if self.k is not None:
                    ch.builder = CompletionLogprobsBuilder(self.k, self._decode_one)
            lps = ch.builder.build(ids, entries) if ch.builder is not None else None
            choice = self._choice(i, j, text, c.token_ids, lps, c.finish_reason, c.stop_reason, first)
            chunks.append(CompletionResponse(id=self.id, model=self.model, choices=[choice]))
        return chunks
