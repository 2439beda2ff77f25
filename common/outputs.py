"""What the engine hands out: token ids per step from the engine core (``EngineCoreOutput``), and the request
outputs made from them, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely token
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the top-k plus the chosen token).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated
    text: str | None
    cum_logprob: float
    score: float  # cum_logprob / generated_len ** length_penalty (HF's sequences_scores)
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first
    request_id: str = ""
    finished: bool = True


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's logprobs as a worker computes them: the chosen token's (sampled, or the prompt's next) and
    the top-k. The output processor turns each into a ``dict[int, Logprob]``."""

    token_id: int
    logprob: float
    rank: int  # of token_id, 1 = most likely
    top_ids: list[int]
    top_logprobs: list[float]  # of top_ids, best first


@dataclass
class EngineCoreOutput:
    """One request's step from the engine core: token ids only, small and picklable. The offline ``LLMEngine``
    consumes these in-process; the Ray engine-core actor streams them to the gateway, which makes text of them
    the same way (``OutputProcessor``)."""

    request_id: str
    new_token_ids: dict[int, list[int]] = field(default_factory=dict)  # completion index -> tokens
    new_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    # After this step, for each completion that got tokens or finished (ranks best_of completions).
    cumulative_logprobs: dict[int, float] = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reasons: dict[int, tuple[str, int | str | None]] = field(default_factory=dict)  # -> (reason, stop_reason)
    finished: bool = False
    num_cached_tokens: int = 0
    beams: list[BeamSearchSequence] | None = None  # beam search, once finished: best first, text unset

    error: str | None = None
    invalid_request: bool = False  # the error is the request's own (its grammar): a bad request, not a retry


@dataclass
class EngineHealth:
    """An engine core telling its gateways, through the output stream, that it cannot serve for now (its workers
    are being rebuilt, or a step hung) or that it can again."""

    healthy: bool
    reason: str = ""
    failed: bool = False  # for good: the model fails every step the same way (``reason`` says how)
    draining: bool = False  # being scaled in or replaced: route nothing new here; its requests will move
