"""The server's conversions: ``pagedserve.v1`` request messages to engine parameters, engine outputs to response
messages."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.common.errors import InvalidRequestError
from pagedserve.common.outputs import BeamSearchOutput, CompletionOutput, Logprob, RequestOutput
from pagedserve.common.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from pagedserve.proto.fields import (
    EARLY_STOPPING_VALUES,
    FINISH_REASONS,
    OPTIONAL_SAMPLING_FIELDS,
    PLAIN_SAMPLING_FIELDS,
    REPEATED_SAMPLING_FIELDS,
)
from pagedserve.proto.v1 import generation_pb2 as pb


@dataclass
class ParsedRequest:
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams | BeamSearchParams
    stream: bool


def _enum(name: str, value: int, known) -> int:
    """Proto3 enums are open: a client may send any number. Refuse the ones this server does not know."""
    if value not in known:
        raise InvalidRequestError(f"{name}: unknown value {value}")
    return value


def _structured_outputs(so: pb.StructuredOutputs) -> StructuredOutputsParams:
    kind = so.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("sampling_params.structured_outputs: set one of json, json_object, regex, choice "
                                  "or grammar")
    value = list(so.choice.choices) if kind == "choice" else getattr(so, kind)
    try:
        return StructuredOutputsParams(**{kind: value}, disable_any_whitespace=so.disable_any_whitespace)
    except ValueError as e:
        raise InvalidRequestError(f"sampling_params.{e}") from None


def params_from_proto(req: pb.GenerateRequest) -> ParsedRequest:
    """Raise InvalidRequestError naming the offending field."""
    _enum("stream_mode", req.stream_mode, pb.StreamMode.values())
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("prompt: set either text or token_ids")
    text = req.text if kind == "text" else None
    ids = list(req.token_ids.ids) if kind == "token_ids" else None
    beam = req.HasField("beam_search")
    if beam and req.HasField("sampling_params"):
        raise InvalidRequestError("beam_search: set either sampling_params or beam_search, not both")
    if beam:
        b = req.beam_search
        early = EARLY_STOPPING_VALUES[_enum("beam_search.early_stopping", b.early_stopping, EARLY_STOPPING_VALUES)]
        kw = {"beam_width": b.beam_width, "max_tokens": b.max_tokens, "ignore_eos": b.ignore_eos,
              "early_stopping": early}
        if b.HasField("length_penalty"):
            kw["length_penalty"] = b.length_penalty
        try:
            params = BeamSearchParams(**kw)
        except ValueError as e:
            raise InvalidRequestError(f"beam_search.{e}") from None
        if req.stream_mode == pb.STREAM_MODE_DELTA:
            raise InvalidRequestError("stream_mode: beam search returns its result at the end; use STREAM_MODE_FINAL")
        return ParsedRequest(text, ids, params, stream=False)
    sp = req.sampling_params
    kw = {name: getattr(sp, name) for name in OPTIONAL_SAMPLING_FIELDS if sp.HasField(name)}
    kw.update({name: list(getattr(sp, name)) for name in REPEATED_SAMPLING_FIELDS})
    kw.update({name: getattr(sp, name) for name in PLAIN_SAMPLING_FIELDS})
    if sp.HasField("structured_outputs"):
        kw["structured_outputs"] = _structured_outputs(sp.structured_outputs)
    try:
        params = SamplingParams(**kw)
    except ValueError as e:
        raise InvalidRequestError(f"sampling_params.{e}") from None
    stream = req.stream_mode != pb.STREAM_MODE_FINAL
    if params.best_of > params.n:
        if req.stream_mode == pb.STREAM_MODE_DELTA:
            raise InvalidRequestError(
                "stream_mode: best_of > n picks the completions at the end; use STREAM_MODE_FINAL")
        stream = False
    return ParsedRequest(text, ids, params, stream)


def _token_logprobs(token: int, entry: dict[int, Logprob], k: int) -> pb.TokenLogprobs:
    """``entry`` holds the top ``k`` tokens plus the chosen one (which may rank lower)."""
    chosen = entry[token]
    msg = pb.TokenLogprobs(token_id=token, logprob=chosen.logprob, rank=chosen.rank or 0,
                           decoded_token=chosen.decoded_token or "")
    for t, lp in sorted(entry.items(), key=lambda x: x[1].rank):
        if lp.rank <= k:
            msg.top_logprobs.add(token_id=t, logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token or "")
    return msg


@dataclass
class ResponseBuilder:
    """Turns the delta ``RequestOutput``s of one request (``OutputProcessor`` with ``delta=True``) into responses."""

    request_id: str
    prompt_len: int
    logprobs: int = 0  # the requested top-k, for splitting logprob dicts
    prompt_logprobs: int = 0
    num_prompt_logprobs_sent: int = 0  # entries sent so far; the first prompt token's (None) is skipped
    num_completion_tokens: int = 0
    done: set[int] = field(default_factory=set)  # completions whose finish reason went out
    cached_prompt_tokens: bool = False  # report them (--enable-prompt-tokens-details)

    def build(self, out: RequestOutput | BeamSearchOutput) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(request_id=self.request_id, finished=out.finished)
        if isinstance(out, BeamSearchOutput):
            return self._beams(resp, out)
        for c in out.outputs:
            self._completion(resp, c)
        if out.prompt_logprobs:  # chunked prefill hands them out a chunk at a time
            first = self.num_prompt_logprobs_sent
            for i, entry in enumerate(out.prompt_logprobs, first):
                if i:
                    resp.prompt_logprobs.append(_token_logprobs(out.prompt_token_ids[i], entry, self.prompt_logprobs))
            self.num_prompt_logprobs_sent += len(out.prompt_logprobs)
        if out.finished:
            resp.usage.prompt_tokens = len(out.prompt_token_ids)
            resp.usage.completion_tokens = self.num_completion_tokens
            if self.cached_prompt_tokens:
                resp.usage.cached_prompt_tokens = out.num_cached_tokens
        return resp

    def _completion(self, resp: pb.GenerateResponse, c: CompletionOutput) -> None:
        if c.index in self.done or (not c.text and not c.token_ids and c.finish_reason is None):
            return
        d = resp.completions.add(index=c.index, text=c.text, token_ids=c.token_ids,
                                 finish_reason=FINISH_REASONS[c.finish_reason])
        if c.logprobs is not None:
            for token, entry in zip(c.token_ids, c.logprobs):
                d.logprobs.append(_token_logprobs(token, entry, self.logprobs))
        if isinstance(c.stop_reason, int):
            d.stop_token_id = c.stop_reason
        elif isinstance(c.stop_reason, str):
            d.stop_string = c.stop_reason
        if c.cumulative_logprob is not None:
            d.cumulative_logprob = c.cumulative_logprob
        self.num_completion_tokens += len(c.token_ids)
        if c.finish_reason is not None:
            self.done.add(c.index)

    def _beams(self, resp: pb.GenerateResponse, out: BeamSearchOutput) -> pb.GenerateResponse:
        for i, b in enumerate(out.sequences):
            resp.completions.add(index=i, text=b.text or "", token_ids=b.tokens[self.prompt_len:],
                                 finish_reason=FINISH_REASONS[b.finish_reason], cumulative_logprob=b.cum_logprob,
                                 beam_score=b.score)
        resp.usage.prompt_tokens = self.prompt_len
        resp.usage.completion_tokens = sum(len(c.token_ids) for c in resp.completions)
        return resp
