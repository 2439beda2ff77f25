"""A request's sampling fields as engine parameters: ``SamplingParams``, or ``BeamSearchParams`` for
``use_beam_search``. Refusals name the field (400)."""
from __future__ import annotations

import re

from pagedserve.cluster.server.openai.errors import OpenAIError
from pagedserve.cluster.server.openai.protocol import SamplingRequest
from pagedserve.common.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

_FIRST_WORD = re.compile(r"\w+")


def _invalid(e: ValueError) -> OpenAIError:
    m = _FIRST_WORD.match(str(e))
    return OpenAIError(400, str(e), m.group(0) if m else None)


def check_common(req: SamplingRequest) -> None:
    if req.logit_bias:
        raise OpenAIError(400, "logit_bias is not supported by this server's engine; send null or {}", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(400, "stream_options is only allowed with stream=true", "stream_options")


def structured_outputs(req: SamplingRequest) -> StructuredOutputsParams | None:
    """vLLM's ``structured_outputs`` (or its older ``guided_*`` fields), or OpenAI's ``response_format`` (one)."""
    so, rf, guided = req.structured_outputs, req.response_format, req.guided
    if guided is not None:
        if so is not None:
            raise OpenAIError(400, "set structured_outputs or the older guided_* fields, not both",
                              "structured_outputs")
        so = guided
    if so is not None and rf is not None and rf.type != "text":
        raise OpenAIError(400, "set structured_outputs or response_format, not both", "response_format")
    try:
        if so is not None:
            return StructuredOutputsParams(json=so.json_, json_object=so.json_object, regex=so.regex,
                                           choice=so.choice, grammar=so.grammar,
                                           disable_any_whitespace=so.disable_any_whitespace)
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise OpenAIError(400, "response_format of type json_schema needs json_schema.schema", "response_format")
        return StructuredOutputsParams(json=rf.json_schema.schema_)
    except ValueError as e:
        field = "response_format" if so is None else "structured_outputs" if guided is None else "guided_*"
        raise OpenAIError(400, str(e), field) from None


def build_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                 prompt_logprobs: int | None = None, best_of: int | None = None,
                 tool_constraint: StructuredOutputsParams | None = None) -> SamplingParams | BeamSearchParams:
    """``tool_constraint``: chat's tool_choice "required" or a named function, which the request's own constraint
    fields cannot accompany (the caller refuses them)."""
    check_common(req)
    constraint = tool_constraint or structured_outputs(req)
    if req.use_beam_search:
        if constraint is not None:
            raise OpenAIError(400, "structured outputs are not available with use_beam_search", "use_beam_search")
        if logprobs is not None or prompt_logprobs is not None:
            raise OpenAIError(400, "logprobs are not available with use_beam_search", "use_beam_search")
        if max_tokens is None:
            raise OpenAIError(400, "use_beam_search needs max_tokens", "max_tokens")
        try:
            return BeamSearchParams(beam_width=max(req.n, best_of or req.n), max_tokens=max_tokens,
                                    ignore_eos=req.ignore_eos, length_penalty=req.length_penalty)
        except ValueError as e:
            raise _invalid(e) from None
    if best_of is not None and best_of > req.n and req.stream:
        raise OpenAIError(400, "best_of > n picks the completions at the end and cannot stream; set stream=false",
                          "best_of")
    try:
        return SamplingParams(
            n=req.n, best_of=best_of, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
            min_p=req.min_p, repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
            max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens, structured_outputs=constraint,
            stream_interval=req.stream_interval)
    except ValueError as e:
        raise _invalid(e) from None
