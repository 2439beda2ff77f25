"""What the scheduler sends to every worker each step, and what comes back.

Kept small and picklable: a sequence's full token ids and block table travel once (``NewSeqData``);
after that only the newly sampled token and newly allocated blocks do (``CachedSeqData``).
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from pagedserve.common.outputs import TokenLogprobs
from pagedserve.common.sampling_params import SamplingParams


@dataclass
class NewSeqData:
    seq_id: int
    token_ids: list[int]
    prompt_len: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    seed: int
    need_prompt_logprobs: bool = False


@dataclass
class CachedSeqData:
    seq_id: int
    new_token_ids: list[int]
    new_block_ids: list[int]  # replace the block table from index num_kept_blocks on
    num_computed_tokens: int
    num_kept_blocks: int  # below len(table) after copy-on-write replaced a block


@dataclass
class SchedulerOutput:
    scheduled_new_seqs: list[NewSeqData] = field(default_factory=list)
    scheduled_cached_seqs: list[CachedSeqData] = field(default_factory=list)
    num_scheduled_tokens: dict[int, int] = field(default_factory=dict)  # seq_id -> tokens this step
    total_num_scheduled_tokens: int = 0
    # Sequences whose worker-side state must be dropped (finished, aborted, preempted).
    finished_seq_ids: set[int] = field(default_factory=set)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    # A best_of request's first sample: seq_id -> the seeds of the best_of - 1 completions that fork from it.
    # Each gets an extra sampling row from the same logits; the scheduler forks them when the results come back.
    fork_seeds: dict[int, list[int]] = field(default_factory=dict)
    # Speculative decoding: seq_id -> draft tokens, run after the sequence's last token this step (they are in
    # num_scheduled_tokens). The sequence gets one sampling row per position: after its last token, then after
    # each draft; the scheduler keeps the drafts that equal the rows' samples, and the first sample after them.
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Structured output: one int32 bitmask row (bit t: token t allowed) per constrained sampling row, and each
    # constrained sequence's first row (its forks share row 0; row j of a drafting sequence follows j drafts).
    # A Future when the runner is in the engine's process: filled while the forward pass runs.
    grammar_bitmask: np.ndarray | Future[np.ndarray] | None = None
    grammar_rows: dict[int, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Results for the sequences that sampled this step, in ``seq_ids`` order. A sequence in ``fork_seeds``
    appears once more per forked completion, right after its own row; one in ``spec_token_ids`` once per draft."""

    seq_ids: list[int]
    sampled_token_ids: list[int]
    sampled_logprobs: list[float] | None = None  # raw logprob of each sampled token
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # per output row that asked for logprobs
    # seq_id -> one entry per prompt position of this chunk (the logprobs of the token that follows it).
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # worker-side seconds: prepare / forward / sample
