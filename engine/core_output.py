"""What the engine core reports per request and step: token ids only, small and picklable.

The offline ``LLMEngine`` consumes these in-process; the Ray scheduler actor streams them to the gateway,
which turns them into text the same way (``OutputProcessor``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler.request import FINISH_REASONS, Request, RequestStatus
from pagedserve.scheduler.scheduler import SeqUpdate

# (sampled logprob, top token ids, top logprobs, rank of the sampled token)
TokenLogprobs = tuple[float, list[int], list[float], int]


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: dict[int, list[int]] = field(default_factory=dict)  # completion index -> tokens
    new_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    # After this step, for each completion that got tokens or finished (ranks best_of completions).
    cumulative_logprobs: dict[int, float] = field(default_factory=dict)
    prompt_logprobs: list | None = None
    finish_reasons: dict[int, tuple[str, int | str | None]] = field(default_factory=dict)  # -> (reason, stop_reason)
    finished: bool = False
    num_cached_tokens: int = 0
    # Beam search, once finished: (prompt + generated ids, cumulative logprob, score, finish reason), best first.
    beams: list[tuple[list[int], float, float, str | None]] | None = None
    error: str | None = None


def make_core_output(upd: SeqUpdate, error: str | None = None) -> EngineCoreOutput:
    req: Request = upd.request
    out = EngineCoreOutput(req.request_id, upd.new_token_ids, upd.new_logprobs, prompt_logprobs=upd.prompt_logprobs,
                           finished=req.finished, num_cached_tokens=req.num_cached_tokens)
    for s in req.seqs:
        if s.index in upd.new_token_ids or s.finished:
            out.cumulative_logprobs[s.index] = s.cumulative_logprob
        if s.finished:
            out.finish_reasons[s.index] = (FINISH_REASONS[s.status], s.stop_reason)
    if req.finished and req.beam_params is not None:
        out.beams = [(h.token_ids, h.cum_logprob, h.score, h.finish_reason) for h in req.beam_state.finished]
    if req.status == RequestStatus.FINISHED_ERROR:
        out.error = error or "the model workers failed while this request ran"
    return out
