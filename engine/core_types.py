"""Plain data between the engine core and its users: the request it queues, what it reports about itself."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.common.config import RequestLimits
from pagedserve.common.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.scheduler.request import DEFAULT_TENANT, Tenant
from pagedserve.scheduler.stats import SchedulerStats


@dataclass
class ResumedCompletion:
    index: int
    output_token_ids: list[int]  # generated so far (and already delivered)
    cumulative_logprob: float


@dataclass
class ResumeState:
    """Where a request stood when the engine running it died, so that another engine goes on from there: the same
    seed (seeded draws depend only on the seed and the output length), each unfinished completion's tokens, and how
    many prompt logprobs went out already. A beam search restarts whole: it is deterministic and streams nothing."""

    seed: int
    completions: list[ResumedCompletion]
    num_prompt_logprobs: int = 0


@dataclass
class EngineCoreRequest:
    """A validated request in token ids, as the engine core queues it (``InputProcessor`` makes these)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # per step; for beam search the greedy step that returns top-k logprobs
    beam_params: BeamSearchParams | None = None
    cache_salt: str | None = None
    resume: ResumeState | None = None
    priority: int = 0  # lower first under --scheduling-policy priority; must be 0 under fcfs (as vLLM)
    tenant: Tenant = DEFAULT_TENANT
    # vLLM's kv_transfer_params "do_remote_decode": prefill only, then hand the KV to a decode replica
    do_remote_decode: bool = False

    @property
    def params(self) -> SamplingParams | BeamSearchParams:
        """The parameters as the user gave them (what the output processor needs)."""
        return self.beam_params if self.beam_params is not None else self.sampling_params


@dataclass(frozen=True)
class EngineInfo:
    """What does not change while an engine runs; the input processor validates against it."""

    model: str
    architecture: str
    dtype: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tensor_parallel_size: int
    block_size: int
    num_kv_blocks: int
    enable_prefix_caching: bool
    limits: RequestLimits
    stream_interval: int = 1  # the output processor's: a streamed output per this many new tokens
    scheduling_policy: str = "fcfs"


@dataclass
class EngineStats:
    """Scheduler and KV-cache state, and counters since start (counters only grow)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_blocks_total: int
    kv_blocks_free: int  # free, or holding only evictable cached prefixes
    kv_blocks_shared: int
    kv_usage: float  # 0..1
    copy_on_write: int
    num_requests: int  # added by users (the warm-up request is not one)
    num_worker_restarts: int
    num_constrained_requests: int  # structured output
    scheduler: SchedulerStats  # a copy of the scheduler's counters
    num_waiting_tokens: int = 0  # prompt tokens of the waiting requests (a prefill pool's queue)
    num_kv_leases: int = 0  # prompts whose KV this (prefill) replica holds for a decode replica's pull
    num_kv_leases_expired: int = 0  # leases that ran out before the pull acknowledged them (counter)


@dataclass
class ScaleResult:
    """What a change of the number of replicas did."""

    num_replicas: int  # serving once the change is done
    added: int
    removed: int
    moved_requests: int  # still running on the removed replicas when their drain ended, moved to others
    model: str | None = None  # the model dir the replicas serve, after a rollout
