"""``POST /v1/chat/completions``: messages rendered with the chat template, then generated as one prompt with
``n`` choices, whole or streamed (each choice's first chunk carries the role)."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable

from starlette.responses import Response

from pagedserve.cluster.server.openai.chat_protocol import (
    MAX_TEMPLATE_KWARGS_CHARS,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    DeltaMessage,
    ResponseFunctionCall,
    ResponseToolCall,
)
from pagedserve.cluster.server.openai.chat_template import ChatTemplate, message_chars, template_message
from pagedserve.cluster.server.openai.errors import OpenAIError
from pagedserve.cluster.server.openai.generation import (
    ADMISSION_WAIT_S,
    GenerationRun,
    Output,
    new_request_id,
    served_model,
)
from pagedserve.cluster.server.openai.logprobs import chat_logprobs, prompt_logprobs_json
from pagedserve.cluster.server.openai.protocol import usage
from pagedserve.cluster.server.openai.sampling import build_params
from pagedserve.cluster.server.openai.sse import EventStreamResponse, sse_events
from pagedserve.cluster.server.openai.tool_calling import (
    ToolPlan,
    check_auto_options,
    plan_tools,
    tool_deltas,
    tools_chars,
)
from pagedserve.cluster.server.openai.tool_parsers import ToolParser
from pagedserve.cluster.server.openai.tool_parsers.types import ToolCallDelta
from pagedserve.cluster.server.state import ServingState
from pagedserve.common.config import utf8_size_over
from pagedserve.common.errors import InvalidRequestError
from pagedserve.common.outputs import BeamSearchOutput, CompletionOutput, Logprob
from pagedserve.common.sampling_params import SamplingParams

FIELDS = set(ChatCompletionRequest.model_fields)
INLINE_RENDER_CHARS = 16_384  # longer conversations are rendered and tokenized off the event loop


class ChatServing:
    def __init__(self, state: ServingState, template: ChatTemplate) -> None:
        check_auto_options(state.options)
        self.state = state
        self.template = template

    def _prompt(self, req: ChatCompletionRequest, plan: ToolPlan) -> tuple[str, list[int]]:
        messages = [template_message(m) for m in req.messages]
        text = self.template.render(messages, req.add_generation_prompt, req.continue_final_message,
                                    req.chat_template_kwargs, plan.tools)
        # The template writes any BOS itself, so nothing is added here (as vLLM tokenizes chat prompts).
        return text, self.state.tokenizer.encode(text, add_special_tokens=False) if text else []

    async def create(self, req: ChatCompletionRequest, session_id: str | None = None) -> Response:
        engine = self.state.ready_engine()
        model = served_model(self.state, req.model)
        kwargs = len(json.dumps(req.chat_template_kwargs)) if req.chat_template_kwargs else 0
        if kwargs > MAX_TEMPLATE_KWARGS_CHARS:
            raise OpenAIError(400, f"chat_template_kwargs exceed {MAX_TEMPLATE_KWARGS_CHARS} characters as JSON",
                              "chat_template_kwargs")
        size = sum(message_chars(m) for m in req.messages) + kwargs + (tools_chars(req.tools) if req.tools else 0)
        plan = plan_tools(req, self.state.options)
        limit = engine.info.limits.max_prompt_bytes
        if size > limit // 4 and utf8_size_over("".join(m.text() for m in req.messages), limit) is not None:
            raise OpenAIError(400, f"the messages exceed {limit} bytes (max_prompt_bytes)", "messages")
        if not req.logprobs and req.top_logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        rid = new_request_id(req.request_id)
        run = GenerationRun(self.state)  # the tenant's limits: a refusal costs no rendering or tokenizing
        run.session_id = session_id or req.user
        handed_off = False
        try:
            if size > INLINE_RENDER_CHARS:
                text, ids = await asyncio.to_thread(self._prompt, req, plan)
            else:
                text, ids = self._prompt(req, plan)
            k = (req.top_logprobs or 0) if req.logprobs else None
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            if max_tokens is None and req.use_beam_search:
                max_tokens = max(1, engine.info.max_model_len - len(ids))
            params = build_params(req, max_tokens, k, req.prompt_logprobs, tool_constraint=plan.constraint)
            if isinstance(params, SamplingParams) and plan.skip_special_tokens is not None:
                params.skip_special_tokens = plan.skip_special_tokens
            run.admit(1, params)
            try:
                await run.add(engine, rid, {"prompt": text, "prompt_token_ids": ids}, params, req.cache_salt,
                              req.priority)
            except InvalidRequestError as e:
                if plan.constraint is None or not str(e).startswith("structured_outputs"):
                    raise
                raise OpenAIError(400, f"tools: the output cannot be constrained to tool_choice's calls: {e}",
                                  "tools") from None
            chat = _Chat(self.state.tokenizer, req, model, rid, run, k, plan)
            outputs = run.outputs(engine, stream=req.stream and not req.use_beam_search)
            if not req.stream:
                async for _, out in outputs:
                    chat.add(out)
                return Response(chat.response().model_dump_json(), media_type="application/json")
            first = await run.first_output(ADMISSION_WAIT_S)
            handed_off = True
            return EventStreamResponse(sse_events(chat.stream(first, outputs), run.fail, FIELDS), run.close)
        except BaseException as e:
            run.failed = isinstance(e, Exception)
            raise
        finally:
            if not handed_off:
                await run.close()


class _Chat:
    def __init__(self, tokenizer, req: ChatCompletionRequest, model: str, rid: str, run: GenerationRun,
                 k: int | None, plan: ToolPlan) -> None:
        self.tokenizer = tokenizer
        self.req = req
        self.model = model
        self.id = f"chatcmpl-{rid}"
        self.prompt = run.prompts[0]
        self.cached_details = run.state.options.prompt_tokens_details
        self.k = k
        self.created = int(time.time())
        self.extras_sent = False
        self.texts: dict[int, list[str]] = {}
        self.token_ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[dict[int, Logprob]]] = {}
        self.finish: dict[int, tuple[str | None, int | str | None]] = {}
        self.prompt_logprobs: list = []
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.beams: BeamSearchOutput | None = None
        self.plan = plan
        self.parsers: dict[int, ToolParser] = {}  # streaming: each choice's
        self.called: set[int] = set()  # streaming: the choices that made calls

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def add(self, out: Output) -> list:
        if isinstance(out, BeamSearchOutput):
            self.beams = out
            n_prompt = len(self.prompt.token_ids)
            self.num_output_tokens = sum(len(b.tokens) - n_prompt for b in out.sequences[:self.req.n])
            return []
        if out.prompt_logprobs:
            self.prompt_logprobs.extend(out.prompt_logprobs)
        if out.finished:
            self.num_cached_tokens = out.num_cached_tokens
        moved = []
        for c in out.outputs:
            self.texts.setdefault(c.index, []).append(c.text)
            self.token_ids.setdefault(c.index, []).extend(c.token_ids)
            if c.logprobs:
                self.logprobs.setdefault(c.index, []).extend(c.logprobs)
            self.num_output_tokens += len(c.token_ids)
            if c.finish_reason is not None:
                self.finish[c.index] = (c.finish_reason, c.stop_reason)
            if c.text or c.token_ids or c.finish_reason is not None:
                moved.append(c)
        return moved

    def _logprobs(self, token_ids: list[int], entries) -> ChatChoiceLogprobs | None:
        if self.k is None:
            return None
        return ChatChoiceLogprobs(content=chat_logprobs(token_ids, entries or [], self.k, self._decode_one))

    def _usage(self):
        return usage(len(self.prompt.token_ids), self.num_output_tokens,
                     self.num_cached_tokens if self.cached_details else None)

    def _beam_choices(self) -> list[tuple[int, str, list[int], str | None]]:
        n_prompt = len(self.prompt.token_ids)
        return [(j, b.text or "", b.tokens[n_prompt:], b.finish_reason)
                for j, b in enumerate(self.beams.sequences[:self.req.n])]

    def _extras(self) -> dict:
        extras = {}
        if self.req.return_token_ids:
            extras["prompt_token_ids"] = list(self.prompt.token_ids)
        if self.req.prompt_logprobs is not None:
            extras["prompt_logprobs"] = prompt_logprobs_json(self.prompt_logprobs)
        return extras

    def response(self) -> ChatCompletionResponse:
        ids = self.req.return_token_ids
        if self.beams is not None:
            choices = [ChatCompletionChoice(index=j, message=ChatResponseMessage(content=text), finish_reason=reason,
                                            token_ids=toks if ids else None)
                       for j, text, toks, reason in self._beam_choices()]
        else:
            choices = []
            for j in sorted(self.texts):
                reason, stop = self.finish.get(j, (None, None))
                message, reason = self._message("".join(self.texts[j]), reason)
                choices.append(ChatCompletionChoice(
                    index=j, message=message,
                    logprobs=self._logprobs(self.token_ids[j], self.logprobs.get(j)), finish_reason=reason,
                    stop_reason=stop, token_ids=self.token_ids[j] if ids else None))
        return ChatCompletionResponse(id=self.id, model=self.model, choices=choices, usage=self._usage(),
                                      **self._extras())

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's "tool_calls" for an output that ended with calls ("stop" for a named function's)."""
        replace = getattr(self.plan.new_parser, "finish_reason", None)
        return replace if called and reason == "stop" and replace else reason

    def _message(self, text: str, reason: str | None) -> tuple[ChatResponseMessage, str | None]:
        if self.plan.new_parser is None:
            return ChatResponseMessage(content=text), reason
        parsed = self.plan.new_parser(stream=False).parse(text)
        calls = parsed.calls if self.plan.parallel else parsed.calls[:1]
        if not calls:
            return ChatResponseMessage(content=text), reason
        tool_calls = [ResponseToolCall(id=c.id, function=ResponseFunctionCall(name=c.name, arguments=c.arguments))
                      for c in calls]
        return ChatResponseMessage(content=parsed.content, tool_calls=tool_calls), self._finish_reason(reason, True)

    def _chunk(self, choices: list[ChatCompletionChunkChoice], **kw) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, **kw)

    async def stream(self, first: Awaitable[tuple[int, Output]],
                     rest: AsyncIterator[tuple[int, Output]]) -> AsyncIterator[list]:
        yield [self._chunk([ChatCompletionChunkChoice(index=j, delta=DeltaMessage(role="assistant", content=""))])
               for j in range(self.req.n)]
        yield self._chunks((await first)[1])
        async for _, out in rest:
            yield self._chunks(out)
        so = self.req.stream_options
        if so is not None and so.include_usage:
            yield [self._chunk([], usage=self._usage())]

    def _chunks(self, out: Output) -> list[ChatCompletionChunk]:
        moved = self.add(out)
        ids = self.req.return_token_ids
        if isinstance(out, BeamSearchOutput):
            return [self._chunk([ChatCompletionChunkChoice(index=j, delta=DeltaMessage(content=text),
                                                           finish_reason=reason, token_ids=toks if ids else None)],
                                **(self._extras() if j == 0 else {}))
                    for j, text, toks, reason in self._beam_choices()]
        if self.plan.new_parser is not None:
            chunks = [chunk for c in moved for chunk in self._tool_chunks(c)]
        else:
            chunks = [self._chunk([ChatCompletionChunkChoice(
                index=c.index, delta=DeltaMessage(content=c.text), logprobs=self._logprobs(c.token_ids, c.logprobs),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason, token_ids=c.token_ids if ids else None)])
                for c in moved]
        if chunks and not self.extras_sent:  # the prompt is prefilled by the first generated token
            self.extras_sent = True
            for name, value in self._extras().items():
                setattr(chunks[0], name, value)
        return chunks

    def _tool_chunks(self, c: CompletionOutput) -> list[ChatCompletionChunk]:
        """A choice's new text through its parser: content and tool-call deltas in output order, one chunk each;
        the first carries the output's logprobs and token ids, the last its finish reason."""
        parser = self.parsers.get(c.index)
        if parser is None:
            parser = self.parsers[c.index] = self.plan.new_parser(stream=True)
        events = parser.feed(c.text) + (parser.finish() if c.finish_reason is not None else [])
        if not self.plan.parallel:
            events = [e for e in events if not isinstance(e, ToolCallDelta) or e.index == 0]
        if any(isinstance(e, ToolCallDelta) for e in events):
            self.called.add(c.index)
        deltas = tool_deltas(events)
        carries = self.k is not None or self.req.return_token_ids
        if not deltas and (c.finish_reason is not None or (carries and c.token_ids)):
            deltas = [DeltaMessage(content="")]
        chunks = [self._chunk([ChatCompletionChunkChoice(index=c.index, delta=d)]) for d in deltas]
        if chunks:
            first, last = chunks[0].choices[0], chunks[-1].choices[0]
            first.logprobs = self._logprobs(c.token_ids, c.logprobs)
            first.token_ids = c.token_ids if self.req.return_token_ids else None
            last.finish_reason = self._finish_reason(c.finish_reason, c.index in self.called)
            last.stop_reason = c.stop_reason
        return chunks

