"""Requests and their sequences as the scheduler sees them: token ids only, no text."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedserve.common.outputs import BeamSearchSequence, TokenLogprobs
from pagedserve.common.sampling_params import BeamSearchParams, SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the workers failed while it ran
    FINISHED_REMOTE_DECODE = 7  # prefill only: ended after its first token, a decode replica goes on

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class Tenant:
    """Who a request is for: its API key's name, a header's value, or the default. Token fairness shares the engine
    between tenants in proportion to ``weight``."""

    name: str = "default"
    weight: float = 1.0


DEFAULT_TENANT = Tenant()


def child_seed(base: int, index: int) -> int:
    """Seed of completion ``index`` of a request seeded with ``base`` (index 0 keeps the base)."""
    if index == 0:
        return base
    x = (base ^ (index * 0x9E3779B97F4A7C15)) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) & _MASK63


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_REMOTE_DECODE: "remote_decode",
}


@dataclass(eq=False)
class Sequence:
    """One completion of a request, with its own block table."""

    seq_id: int
    index: int  # completion index within the request
    token_ids: list[int]  # prompt + generated tokens
    prompt_len: int
    seed: int
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # How many of token_ids / block_table entries the workers already hold.
    num_sent_tokens: int = 0
    num_sent_blocks: int = 0
    cumulative_logprob: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # of its full, computed blocks
    spec_token_ids: list[int] = field(default_factory=list)  # this step's draft tokens, scheduled after the last

    def fork(self, seq_id: int, index: int, seed: int) -> Sequence:
        """A child with the same tokens and progress; the block manager shares the blocks."""
        return Sequence(seq_id=seq_id, index=index, token_ids=list(self.token_ids), prompt_len=self.prompt_len,
                        seed=seed, num_computed_tokens=self.num_computed_tokens,
                        cumulative_logprob=self.cumulative_logprob, status=self.status)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run through the model: the uncomputed ones and this step's drafts."""
        return len(self.token_ids) + len(self.spec_token_ids) - self.num_computed_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.status.finished


@dataclass
class BeamState:
    """A beam search's progress (see ``scheduler/beam.py``)."""

    eos_ids: set[int]
    max_length: int  # prompt + max_tokens
    num_candidates: int
    finished: list[BeamSearchSequence] = field(default_factory=list)  # best first, at most W; text unset
    improvable: bool = True  # HF's early-stop heuristic not yet satisfied
    pending: dict[int, TokenLogprobs] = field(default_factory=dict)  # seq_id -> its top-k this step
    done: bool = False


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seqs: list[Sequence]
    arrival_index: int  # FCFS order; preemption picks the highest
    priority: int = 0  # with the priority policy, lower runs first (vLLM's)
    tenant: Tenant = DEFAULT_TENANT
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    prompt_logprobs_done: bool = False
    num_prompt_logprobs: int = 0  # prompt positions whose logprobs went out (a recompute does not repeat them)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_resumes: int = 0  # times its workers failed under it and it started over from its tokens
    first_scheduled_time: float | None = None
    last_scheduled_time: float = 0.0  # the schedule() that last gave it tokens (a held decode's wait counts from it)
    cache_salt: str | None = None
    seed: int = 0  # the base seed; completion i samples with child_seed(seed, i)
    next_seq_index: int = 1
    beam_params: BeamSearchParams | None = None  # set for beam-search requests, with beam_state
    beam_state: BeamState | None = None
    remote_decode: bool = False  # prefill only: end after the first token, its prompt's KV held for a decode replica

    @property
    def live_seqs(self) -> list[Sequence]:
        if len(self.seqs) == 1:  # most requests; called several times per step
            seq = self.seqs[0]
            return [] if seq.finished else [seq]
        return [s for s in self.seqs if not s.finished]

    @property
    def finished(self) -> bool:
        return self.status.finished
