"""The online engine API: text in, ``RequestOutput`` out, driven one ``step()`` at a time."""
from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass, field

from pagedserve.config import EngineArgs, EngineConfig
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.engine_core import EngineCore
from pagedserve.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.scheduler.request import FINISH_REASONS, Request, RequestStatus
from pagedserve.scheduler.scheduler import SeqUpdate

PromptType = str | list[int] | dict


@dataclass
class _Completion:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    detok: IncrementalDetokenizer | None = None
    text: str = ""


@dataclass
class _RequestState:
    request: Request
    prompt: str | None
    params: SamplingParams
    stream: bool
    completions: list[_Completion]
    prompt_logprobs: list | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: str | None = None, executor_cls=None,
                 skip_tokenizer_init: bool = False) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.tokenizer = None if skip_tokenizer_init else AutoTokenizer.from_pretrained(
            tokenizer or config.model_config.model)
        self.core = EngineCore(config, executor_cls)
        self.eos_token_ids = set(config.model_config.eos_token_ids)
        self.states: dict[str, _RequestState] = {}
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, executor_cls=None) -> "LLMEngine":
        return cls(args.create_engine_config(), args.tokenizer, executor_cls, args.skip_tokenizer_init)

    # ---- requests ----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise ValueError(f"unknown prompt fields {sorted(unknown)}")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list):
            return None, list(prompt)
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; this engine runs with skip_tokenizer_init")
        return prompt, self.tokenizer.encode(prompt) if prompt else []

    def prepare_params(self, params: SamplingParams | None) -> SamplingParams:
        params = copy.copy(params) if params is not None else SamplingParams()
        params.verify()
        params.all_stop_token_ids = set() if params.ignore_eos else set(self.eos_token_ids)
        return params

    def validate(self, prompt: PromptType, params: SamplingParams | BeamSearchParams | None):
        """Tokenize and check a request without queueing it: (prompt text, token ids, params)."""
        text, ids = self.tokenize_prompt(prompt)
        if isinstance(params, BeamSearchParams):
            self.core.validate(ids, self.core.beam_sampling_params(params), params.beam_width)
            return text, ids, params
        params = self.prepare_params(params)
        self.core.validate(ids, params)
        return text, ids, params

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | BeamSearchParams | None = None, stream: bool = False) -> str:
        """Queue a request. ``stream`` detokenizes every step (for streaming) rather than at the end.
        With ``BeamSearchParams`` it is a beam search, whose single output is a ``BeamSearchOutput``."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already running")
        text, ids, params = self.validate(prompt, params)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        req = self.core.add_request(request_id, ids, params, cache_salt=salt)
        if isinstance(params, BeamSearchParams):
            self.states[request_id] = _RequestState(req, text, req.sampling_params, False, [])
            return request_id
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine runs with skip_tokenizer_init")
        incremental = (stream or bool(params.stop)) and self.tokenizer is not None
        completions = [_Completion(i, detok=IncrementalDetokenizer(self.tokenizer, ids, params) if incremental else None,
                                   logprobs=[] if params.logprobs is not None else None,
                                   cumulative_logprob=0.0 if params.logprobs is not None else None)
                       for i in range(params.best_of)]
        self.states[request_id] = _RequestState(req, text, params, stream, completions,
                                                prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.core.abort_request(rid)
            self.states.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.core.scheduler.num_unfinished

    # ---- stepping ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = []
        for upd in self.core.step():
            st = self.states.get(upd.request.request_id)
            if st is None:
                continue
            self._apply(st, upd)
            finished = st.request.finished
            if finished or st.stream:
                outputs.append(self._make_output(st, finished))
            if finished:
                del self.states[st.request.request_id]
        return outputs

    def _decoded(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def _logprob_dict(self, token: int, lp: float, rank: int, top_ids: list[int], top_lps: list[float]):
        d = {t: Logprob(v, r + 1, self._decoded(t)) for r, (t, v) in enumerate(zip(top_ids, top_lps))}
        d[token] = Logprob(lp, rank, self._decoded(token))
        return d

    def _apply(self, st: _RequestState, upd: SeqUpdate) -> None:
        if st.request.beam_params is not None:
            return
        if upd.prompt_logprobs and st.prompt_logprobs is not None:
            st.prompt_logprobs += [self._logprob_dict(*entry) for entry in upd.prompt_logprobs]
        if upd.new_token_ids and st.first_token_time is None:
            st.first_token_time = time.monotonic()
        for idx, toks in upd.new_token_ids.items():
            c = st.completions[idx]
            c.token_ids.extend(toks)
            if c.logprobs is not None:
                for tok, (lp, top_ids, top_lps, rank) in zip(toks, upd.new_logprobs.get(idx, [])):
                    c.cumulative_logprob += lp
                    c.logprobs.append(self._logprob_dict(tok, lp, rank, top_ids, top_lps))
            if c.detok is not None and c.finish_reason is None and c.detok.add_tokens(toks):
                c.finish_reason, c.stop_reason = "stop", c.detok.stop_reason
                self.core.scheduler.stop_sequence(st.request, idx)
        for seq in st.request.seqs:
            c = st.completions[seq.index]
            if seq.finished and c.finish_reason is None:
                c.finish_reason = FINISH_REASONS[seq.status]
                c.stop_reason = seq.stop_reason

    def _beam_output(self, st: _RequestState) -> BeamSearchOutput:
        seqs = []
        for h in st.request.beam_state.finished:
            text = None
            if self.tokenizer is not None:
                text = self.tokenizer.decode(h.token_ids[len(st.request.prompt_token_ids):], skip_special_tokens=True)
            seqs.append(BeamSearchSequence(h.token_ids, text, h.cum_logprob, h.score, h.finish_reason))
        return BeamSearchOutput(seqs, st.request.request_id)

    def _make_output(self, st: _RequestState, finished: bool) -> RequestOutput | BeamSearchOutput:
        if st.request.beam_params is not None:
            return self._beam_output(st)
        outs = []
        completions = st.completions
        n, best_of = st.params.n, st.params.best_of
        if best_of > n:
            # The n most likely of the best_of completions, renumbered; until then, the first n.
            cum = {s.index: s.cumulative_logprob for s in st.request.seqs}
            if finished:
                completions = sorted(completions, key=lambda c: cum.get(c.index, float("-inf")), reverse=True)
            completions = completions[:n]
        for c in completions:
            if c.detok is not None:
                if c.finish_reason is not None and c.detok.stop_reason is None:
                    c.detok.flush()
                c.detok.take_delta(c.finish_reason is not None)
                text = c.detok.text[: c.detok.num_sent_chars]
            elif self.tokenizer is None:
                text = ""
            else:
                text = self.tokenizer.decode(c.token_ids, skip_special_tokens=st.params.skip_special_tokens,
                                             spaces_between_special_tokens=st.params.spaces_between_special_tokens)
            cum = c.cumulative_logprob
            if cum is None and best_of > n:
                cum = next(s.cumulative_logprob for s in st.request.seqs if s.index == c.index)
            outs.append(CompletionOutput(len(outs) if best_of > n else c.index, text, list(c.token_ids), cum,
                                         c.logprobs, c.finish_reason, c.stop_reason))
        now = time.monotonic()
        metrics = {"arrival_time": st.arrival_time, "finished_time": now if finished else 0.0,
                   "time_to_first_token": (st.first_token_time or now) - st.arrival_time}
        return RequestOutput(st.request.request_id, st.prompt, list(st.request.prompt_token_ids),
                             st.prompt_logprobs, outs, finished, st.request.num_cached_tokens, metrics)
