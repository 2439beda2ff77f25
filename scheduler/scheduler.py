"""Iteration-level scheduling: every step, running requests first, then waiting ones (FCFS).

Each sequence tracks ``num_computed_tokens``; a step schedules ``num_tokens - num_computed_tokens``
of them (capped by the token budget), which covers prefill, chunked prefill, decode and
recompute-after-preemption alike. A sequence samples when its scheduled chunk reaches its last token.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from pagedserve.config import SchedulerConfig
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.output import CachedSeqData, ModelRunnerOutput, NewSeqData, SchedulerOutput
from pagedserve.scheduler.request import Request, RequestStatus, Sequence


@dataclass
class SchedulerStats:
    num_preemptions: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})
    num_steps: int = 0
    # KV waste: allocated-but-unfilled slots / allocated slots, summed over steps (for the mean).
    waste_sum: float = 0.0
    peak_blocks_used: int = 0


@dataclass
class SeqUpdate:
    """What changed for one request this step (token ids only; the engine adds text)."""

    request: Request
    new_token_ids: dict[int, list[int]] = field(default_factory=dict)  # completion index -> tokens
    new_logprobs: dict[int, list[tuple[float, list[int], list[float], int]]] = field(default_factory=dict)
    prompt_logprobs: list | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.block_manager = BlockManager(num_blocks, block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival_index
        self.requests: dict[str, Request] = {}
        self.seqs: dict[int, tuple[Request, Sequence]] = {}
        self._finished_seq_ids: set[int] = set()
        self.stats = SchedulerStats()

    # ---- request lifecycle -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.seqs[seq.seq_id] = (request, seq)
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self._finish_request(req, RequestStatus.FINISHED_ABORTED)
        return req

    def stop_sequence(self, req: Request, index: int) -> None:
        """Finish one completion early (a stop string matched in the engine's detokenizer)."""
        seq = req.seqs[index]
        if seq.finished or req.finished:
            return
        self._finish_seq(seq, RequestStatus.FINISHED_STOPPED)
        if not req.live_seqs:
            self._finish_request(req, RequestStatus.FINISHED_STOPPED)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _finish_seq(self, seq: Sequence, status: RequestStatus) -> None:
        seq.status = status
        self.block_manager.free(seq)
        self._finished_seq_ids.add(seq.seq_id)
        self.seqs.pop(seq.seq_id, None)

    def _finish_request(self, req: Request, status: RequestStatus) -> None:
        for seq in req.live_seqs:
            self._finish_seq(seq, status)
        if req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        req.status = status
        del self.requests[req.request_id]

    # ---- scheduling --------------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        """Recompute preemption: drop the KV, keep the tokens; resumes ahead of new arrivals."""
        self.running.remove(req)
        for seq in req.live_seqs:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.num_sent_tokens = 0
            seq.status = RequestStatus.WAITING
            self._finished_seq_ids.add(seq.seq_id)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.stats.num_preemptions["recompute"] += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_seq_ids=self._finished_seq_ids)
        self._finished_seq_ids = set()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            seqs = req.live_seqs
            # Prefill chunks of one sequence can be long; decodes of a request's sequences go together.
            n = min(max(s.num_tokens - s.num_computed_tokens for s in seqs), budget // len(seqs))
            if n <= 0:
                break
            scheduled_self = True
            while not all(bm.allocate_slots(s, min(n, s.num_tokens - s.num_computed_tokens)) for s in seqs):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    scheduled_self = False
                    break
            if not scheduled_self:
                break
            for s in seqs:
                budget -= self._schedule_seq(out, req, s, min(n, s.num_tokens - s.num_computed_tokens))
            i += 1

        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            seqs = req.live_seqs
            remaining = max(s.num_tokens - s.num_computed_tokens for s in seqs)
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            n = min(remaining, budget // len(seqs))
            if n <= 0 or not bm.can_admit(seqs, n, use_watermark=bool(self.running)):
                break
            for s in seqs:
                bm.allocate_slots(s, n)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            bisect.insort(self.running, req, key=lambda r: r.arrival_index)
            for s in seqs:
                s.status = RequestStatus.RUNNING
                budget -= self._schedule_seq(out, req, s, n)

        self._record_stats()
        return out

    def _schedule_seq(self, out: SchedulerOutput, req: Request, seq: Sequence, n: int) -> int:
        if seq.num_sent_tokens == 0:
            out.scheduled_new_seqs.append(NewSeqData(
                seq_id=seq.seq_id, token_ids=list(seq.token_ids), prompt_len=seq.prompt_len,
                block_ids=list(seq.block_table), num_computed_tokens=seq.num_computed_tokens,
                sampling_params=req.sampling_params, seed=seq.seed,
                need_prompt_logprobs=req.sampling_params.prompt_logprobs is not None
                and not req.prompt_logprobs_done))
        else:
            out.scheduled_cached_seqs.append(CachedSeqData(
                seq_id=seq.seq_id, new_token_ids=seq.token_ids[seq.num_sent_tokens:],
                new_block_ids=seq.block_table[seq.num_sent_blocks:],
                num_computed_tokens=seq.num_computed_tokens))
        seq.num_sent_tokens = seq.num_tokens
        seq.num_sent_blocks = len(seq.block_table)
        seq.num_computed_tokens += n
        out.num_scheduled_tokens[seq.seq_id] = n
        out.total_num_scheduled_tokens += n
        return n

    def _record_stats(self) -> None:
        bm = self.block_manager
        used = bm.num_blocks - bm.num_free_blocks
        st = self.stats
        st.num_steps += 1
        st.peak_blocks_used = max(st.peak_blocks_used, used)
        if used:
            filled = sum(s.num_computed_tokens for r in self.running for s in r.live_seqs)
            st.waste_sum += 1.0 - filled / (used * self.block_size)

    # ---- results -----------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput,
                           max_model_len: int) -> list[SeqUpdate]:
        updates: dict[str, SeqUpdate] = {}
        for seq_id, plps in result.prompt_logprobs.items():
            if seq_id not in self.seqs:
                continue
            req, seq = self.seqs[seq_id]
            upd = updates.setdefault(req.request_id, SeqUpdate(req))
            upd.prompt_logprobs = (upd.prompt_logprobs or []) + plps
            if seq.num_computed_tokens >= seq.prompt_len:
                req.prompt_logprobs_done = True
        logprobs = result.sampled_logprobs
        for k, (seq_id, token) in enumerate(zip(result.seq_ids, result.sampled_token_ids)):
            if seq_id not in self.seqs:  # aborted while the step ran
                continue
            req, seq = self.seqs[seq_id]
            seq.token_ids.append(token)
            upd = updates.setdefault(req.request_id, SeqUpdate(req))
            upd.new_token_ids.setdefault(seq.index, []).append(token)
            if logprobs is not None:
                seq.cumulative_logprob += logprobs[k]
                top = result.top_logprobs.get(seq_id, ([], [], 0))
                upd.new_logprobs.setdefault(seq.index, []).append((logprobs[k], top[0], top[1], top[2]))
            status = self._check_stop(req, seq, token, max_model_len)
            if status is not None:
                self._finish_seq(seq, status)
                if not req.live_seqs:
                    self._finish_request(req, status)
        return list(updates.values())

    @staticmethod
    def _check_stop(req: Request, seq: Sequence, token: int, max_model_len: int) -> RequestStatus | None:
        sp = req.sampling_params
        n_out = seq.num_output_tokens
        if n_out >= sp.min_tokens:
            if token in sp.stop_token_ids:
                seq.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if token in sp.all_stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if (sp.max_tokens is not None and n_out >= sp.max_tokens) or seq.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
