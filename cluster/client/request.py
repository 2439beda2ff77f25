"""Building ``GenerateRequest`` messages from Python values, and folding the streamed responses into results."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from pagedserve.proto.fields import (
    EARLY_STOPPING,
    FINISH_NAMES,
    REPEATED_SAMPLING_FIELDS,
    SAMPLING_FIELDS,
    STRUCTURED_OUTPUT_KINDS,
)
from pagedserve.proto.v1 import generation_pb2 as pb


def sampling_params_to_proto(**kwargs) -> pb.SamplingParams:
    unknown = sorted(set(kwargs) - set(SAMPLING_FIELDS))
    if unknown:
        raise TypeError(f"unknown sampling parameters: {unknown}")
    msg = pb.SamplingParams()
    for name, value in kwargs.items():
        if value is None:
            continue
        if name == "structured_outputs":
            msg.structured_outputs.CopyFrom(structured_outputs_to_proto(**value))
        elif name in REPEATED_SAMPLING_FIELDS:
            getattr(msg, name).extend([value] if isinstance(value, str) else value)
        else:
            setattr(msg, name, value)
    return msg


def structured_outputs_to_proto(disable_any_whitespace: bool = False, **kind) -> pb.StructuredOutputs:
    """One of json (a schema as a dict or JSON text), json_object, regex, choice (a list) or grammar; JSON without
    whitespace beyond the compact form with ``disable_any_whitespace``."""
    unknown = sorted(set(kind) - set(STRUCTURED_OUTPUT_KINDS))
    if unknown or len(kind) != 1:
        raise TypeError(f"structured_outputs takes exactly one of {STRUCTURED_OUTPUT_KINDS} (and "
                        f"disable_any_whitespace), got {sorted(kind)}")
    (name, value), = kind.items()
    if name == "json" and not isinstance(value, str):
        value = json.dumps(value)
    if name == "choice":
        value = pb.ChoiceList(choices=value)
    return pb.StructuredOutputs(**{name: value}, disable_any_whitespace=disable_any_whitespace)


def beam_search_to_proto(beam_width: int, max_tokens: int, ignore_eos: bool = False, length_penalty: float = 1.0,
                         early_stopping: bool | str = False) -> pb.BeamSearchParams:
    if early_stopping not in EARLY_STOPPING:
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    return pb.BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, ignore_eos=ignore_eos,
                               length_penalty=length_penalty, early_stopping=EARLY_STOPPING[early_stopping])


@dataclass
class Delta:
    """New output of one completion, as it streams."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list = field(default_factory=list)  # pb.TokenLogprobs per new token


@dataclass
class Completion:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    beam_score: float | None = None
    logprobs: list = field(default_factory=list)


@dataclass
class GenerateResult:
    request_id: str
    completions: list[Completion]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    prompt_logprobs: list = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.completions[0].text


def build_request(prompt: str | list[int], request_id: str | None = None, stream: bool = True,
                  beam_search: dict | None = None, cache_salt: str | None = None, priority: int = 0,
                  **sampling) -> pb.GenerateRequest:
    """``sampling`` takes SamplingParams' names (max_tokens, temperature, n, stop, seed, logprobs, ...);
    ``beam_search`` a dict of BeamSearchParams' (beam_width, max_tokens, length_penalty, early_stopping);
    ``priority``: lower runs first on a server with ``--scheduling-policy priority`` (vLLM's)."""
    req = pb.GenerateRequest(request_id=request_id or uuid.uuid4().hex, cache_salt=cache_salt or "",
                             priority=priority,
                             stream_mode=pb.STREAM_MODE_UNSPECIFIED if stream else pb.STREAM_MODE_FINAL)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    if beam_search is not None:
        if sampling:
            raise TypeError("beam_search takes no sampling parameters")
        req.beam_search.CopyFrom(beam_search_to_proto(**beam_search))
    elif sampling:
        req.sampling_params.CopyFrom(sampling_params_to_proto(**sampling))
    return req


def accumulate(result: GenerateResult, resp: pb.GenerateResponse) -> list[Delta]:
    """Fold one response into ``result``; return its deltas."""
    deltas = []
    for d in resp.completions:
        while len(result.completions) <= d.index:
            result.completions.append(Completion(len(result.completions)))
        c = result.completions[d.index]
        c.text += d.text
        c.token_ids += list(d.token_ids)
        c.logprobs += list(d.logprobs)
        c.finish_reason = FINISH_NAMES[d.finish_reason]
        kind = d.WhichOneof("stop_reason")
        if kind is not None:
            c.stop_reason = getattr(d, kind)
        if d.HasField("cumulative_logprob"):
            c.cumulative_logprob = d.cumulative_logprob
        if d.HasField("beam_score"):
            c.beam_score = d.beam_score
        deltas.append(Delta(resp.request_id, d.index, d.text, list(d.token_ids), c.finish_reason, list(d.logprobs)))
    result.prompt_logprobs += list(resp.prompt_logprobs)
    if resp.HasField("usage"):
        u = resp.usage
        result.prompt_tokens, result.completion_tokens = u.prompt_tokens, u.completion_tokens
        result.cached_prompt_tokens = u.cached_prompt_tokens
    return deltas
