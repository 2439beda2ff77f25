"""The scheduler's counters since start (they only grow); the engine core hands out copies in ``EngineStats``."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    num_preemptions: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})
    num_swapped_in_blocks: int = 0
    num_swapped_out_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which served from cached blocks
    num_steps: int = 0
    num_scheduled_tokens: int = 0  # tokens run through the model (prefill + decode)
    # KV waste: allocated-but-unfilled slots / allocated slots, summed over steps (for the mean).
    waste_sum: float = 0.0
    peak_blocks_used: int = 0
    # Speculative decoding, with vLLM's meanings: sequences that got drafts, draft tokens scheduled, drafts
    # accepted, and accepted drafts by position (index 0: the first draft of a step).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
