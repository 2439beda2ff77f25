"""Turns ``EngineCoreOutput`` (token ids) into ``RequestOutput`` (text): incremental detokenization, stop strings,
logprob dicts and best_of selection. The offline engine and the gRPC gateway both use it."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.common.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    RequestOutput,
    TokenLogprobs,
)
from pagedserve.common.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.engine.core_types import ResumedCompletion, ResumeState
from pagedserve.engine.detokenizer import IncrementalDetokenizer


@dataclass
class _Completion:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    detok: IncrementalDetokenizer | None = None
    num_sent_tokens: int = 0  # delta outputs: tokens (and their logprobs) already handed out


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    stream: bool
    completions: list[_Completion]
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    beams: list[BeamSearchSequence] | None = None
    delta: bool = False  # outputs carry only what is new since the previous one
    stream_interval: int = 1  # streamed: an output once a completion has this many unsent tokens
    num_prompt_logprobs: int = 0  # prompt positions whose logprobs came in

    @property
    def is_beam(self) -> bool:
        return isinstance(self.params, BeamSearchParams)


class OutputProcessor:
    """``stop_fn(request_id, index)`` ends a completion in the engine core once a stop string matched here;
    tokens the core produced for it in the meantime are dropped, so the result does not depend on the delay."""

    def __init__(self, tokenizer, stop_fn: Callable[[str, int], None], stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.stop_fn = stop_fn
        self.stream_interval = stream_interval  # vLLM's --stream-interval; a request's own may raise it
        self.states: dict[str, _RequestState] = {}
        # Each logprob entry names its token's text: cached per token id, as prompt logprobs ask for tens of
        # thousands of single-token decodes.
        self._token_text: dict[int, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams | BeamSearchParams, stream: bool = False, delta: bool = False) -> None:
        """``stream``: an output every step, else only the final one. ``delta``: each output holds only the text,
        tokens, logprobs and prompt logprobs that are new since the previous one (vLLM's ``RequestOutputKind.DELTA``;
        the gateway streams this way), else everything so far. Its prompt_token_ids is then the caller's list.
        Streamed, an output goes out every step, or with a stream interval above 1 once a completion has its first
        token, that many unsent tokens, or its end (as vLLM's ``stream_interval``)."""
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already running")
        if isinstance(params, BeamSearchParams):
            self.states[request_id] = _RequestState(request_id, prompt, prompt_token_ids, params, False, [])
            return
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine runs with skip_tokenizer_init")
        incremental = (stream or bool(params.stop)) and self.tokenizer is not None
        completions = [_Completion(i, logprobs=[] if params.logprobs is not None else None,
                                   detok=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
                                   if incremental else None)
                       for i in range(params.best_of)]
        self.states[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, params, stream, completions,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None, delta=delta,
            stream_interval=max(self.stream_interval, params.stream_interval or 1))

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def resume_state(self, request_id: str, seed: int) -> ResumeState:
        """Where a request stands, for another engine to go on from (its unfinished completions' tokens)."""
        st = self.states[request_id]
        completions = [] if st.is_beam else [ResumedCompletion(c.index, list(c.token_ids), c.cumulative_logprob)
                                             for c in st.completions if c.finish_reason is None]
        return ResumeState(seed, completions, st.num_prompt_logprobs)

    def abort_output(self, request_id: str) -> RequestOutput | BeamSearchOutput | None:
        """Drop a request, returning its final output with the unfinished completions marked "abort"."""
        st = self.states.pop(request_id, None)
        if st is None:
            return None
        for c in st.completions:
            c.finish_reason = c.finish_reason or "abort"
        return self._make_output(st, True)

    def process(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput | BeamSearchOutput]:
        results = []
        for out in outputs:
            st = self.states.get(out.request_id)
            if st is None:  # aborted, or ended here by a stop string
                continue
            self._apply(st, out)
            finished = out.finished or (not st.is_beam and all(c.finish_reason for c in st.completions))
            if finished or (st.stream and _due(st)):
                results.append(self._make_output(st, finished))
            if finished:
                del self.states[out.request_id]
        return results

    def _decoded(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        d = {t: Logprob(v, r + 1, self._decoded(t)) for r, (t, v) in enumerate(zip(entry.top_ids, entry.top_logprobs))}
        d[entry.token_id] = Logprob(entry.logprob, entry.rank, self._decoded(entry.token_id))
        return d

    def _apply(self, st: _RequestState, out: EngineCoreOutput) -> None:
        st.num_cached_tokens = out.num_cached_tokens
        if st.is_beam:
            st.beams = out.beams
            return
        if out.prompt_logprobs and st.prompt_logprobs is not None:
            st.prompt_logprobs += [self._logprob_dict(entry) for entry in out.prompt_logprobs]
            st.num_prompt_logprobs += len(out.prompt_logprobs)
        if out.new_token_ids and st.first_token_time is None:
            st.first_token_time = time.monotonic()
        for idx, toks in out.new_token_ids.items():
            c = st.completions[idx]
            if c.finish_reason is not None:
                continue
            c.token_ids.extend(toks)
            c.cumulative_logprob = out.cumulative_logprobs.get(idx, c.cumulative_logprob)
            if c.logprobs is not None:
                c.logprobs += [self._logprob_dict(entry) for entry in out.new_logprobs.get(idx, [])]
            if c.detok is not None and c.detok.add_tokens(toks):
                c.finish_reason, c.stop_reason = "stop", c.detok.stop_reason
                self.stop_fn(st.request_id, idx)
        for idx, (reason, stop_reason) in out.finish_reasons.items():
            c = st.completions[idx]
            if c.finish_reason is None:
                c.finish_reason, c.stop_reason = reason, stop_reason
                c.cumulative_logprob = out.cumulative_logprobs.get(idx, c.cumulative_logprob)

    def _beam_output(self, st: _RequestState) -> BeamSearchOutput:
        seqs = st.beams or []
        if self.tokenizer is not None:
            n = len(st.prompt_token_ids)
            seqs = [dataclasses.replace(b, text=self.tokenizer.decode(b.tokens[n:], skip_special_tokens=True))
                    for b in seqs]
        return BeamSearchOutput(seqs, st.request_id)

    def _make_output(self, st: _RequestState, finished: bool) -> RequestOutput | BeamSearchOutput:
        if st.is_beam:
            return self._beam_output(st)
        params = st.params
        completions = st.completions
        n, best_of = params.n, params.best_of
        if best_of > n:
            # The n most likely of the best_of completions, renumbered; until then, the first n.
            if finished:
                completions = sorted(completions, key=lambda c: c.cumulative_logprob, reverse=True)
            completions = completions[:n]
        outs = []
        for c in completions:
            start = c.num_sent_tokens if st.delta else 0
            if c.detok is not None:
                if c.finish_reason is not None and c.detok.stop_reason is None:
                    c.detok.flush()
                sent = c.detok.num_sent_chars
                c.detok.take_delta(c.finish_reason is not None)
                text = c.detok.text[sent if st.delta else 0: c.detok.num_sent_chars]
            elif self.tokenizer is None:
                text = ""
            else:
                text = self.tokenizer.decode(c.token_ids, skip_special_tokens=params.skip_special_tokens,
                                             spaces_between_special_tokens=params.spaces_between_special_tokens)
            cum = c.cumulative_logprob if params.logprobs is not None or best_of > n else None
            logprobs = c.logprobs[start:] if st.delta and c.logprobs is not None else c.logprobs
            outs.append(CompletionOutput(len(outs) if best_of > n else c.index, text, c.token_ids[start:], cum,
                                         logprobs, c.finish_reason, c.stop_reason))
            c.num_sent_tokens = len(c.token_ids)
        prompt_logprobs = st.prompt_logprobs
        if st.delta and prompt_logprobs is not None:
            st.prompt_logprobs = []  # these go out now; later prefill chunks collect anew
        now = time.monotonic()
        metrics = {"arrival_time": st.arrival_time, "finished_time": now if finished else 0.0,
                   "time_to_first_token": (st.first_token_time or now) - st.arrival_time}
        prompt_ids = st.prompt_token_ids if st.delta else list(st.prompt_token_ids)
        return RequestOutput(st.request_id, st.prompt, prompt_ids, prompt_logprobs, outs, finished,
                             st.num_cached_tokens, metrics)


def _due(st: _RequestState) -> bool:
    """Whether a streamed request's output goes out this step (see ``OutputProcessor.add_request``)."""
    if st.stream_interval == 1:
        return True
    for c in st.completions:
        unsent = len(c.token_ids) - c.num_sent_tokens
        if unsent and (unsent >= st.stream_interval or c.num_sent_tokens == 0 or c.finish_reason is not None):
            return True
    return False
