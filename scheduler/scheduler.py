"""Iteration-level scheduling: every step, running requests first, then swapped, then waiting, each in the
policy's order (``request_queue.py``: arrival, or priority then arrival, with token fairness between tenants).

Each sequence tracks ``num_computed_tokens``; a step schedules ``num_tokens - num_computed_tokens``
of them (capped by the token budget), which covers prefill, chunked prefill, decode and
recompute-after-preemption alike. A sequence samples when its scheduled chunk reaches its last token.
When blocks run out the last in that order is preempted: its KV is dropped and recomputed later, or,
for requests with several sequences (parallel sampling, beams), swapped out to CPU blocks. Under the priority policy
a waiting request that cannot start preempts running requests of a worse priority first.
With ``max_decode_stall_ms`` set, running decodes sit out steps while prompts wait (prefill first), each for at most
that long since it last ran.
"""
from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from dataclasses import dataclass

from pagedserve.common.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedserve.common.outputs import EngineCoreOutput
from pagedserve.scheduler.beam import BeamSearcher
from pagedserve.scheduler.block_manager import NULL_BLOCK, BlockManager
from pagedserve.scheduler.kv_leases import KVLeases
from pagedserve.scheduler.output import CachedSeqData, ModelRunnerOutput, NewSeqData, SchedulerOutput
from pagedserve.scheduler.request import FINISH_REASONS, Request, RequestStatus, Sequence, child_seed
from pagedserve.scheduler.request_queue import FAIRNESS_MODES, TokenFairness, WaitingQueue, order_key
from pagedserve.scheduler.spec_decode import propose_ngram
from pagedserve.scheduler.stats import SchedulerStats
from pagedserve.scheduler.structured_output import StructuredOutputManager


@dataclass
class _StepBudget:
    tokens: int  # left to schedule this step
    preempted: bool = False
    prefilling: bool = False  # a prompt chunk is in this step


class Scheduler:
    """``cache_config`` comes with ``num_blocks`` and ``num_cpu_blocks`` resolved from the workers' memory."""

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig,
                 spec_config: SpeculativeConfig | None = None,
                 structured: StructuredOutputManager | None = None) -> None:
        self.config = config
        self.spec_config = spec_config
        self.structured = structured
        self.block_size = cache_config.block_size
        self.block_manager = BlockManager(cache_config.num_blocks, cache_config.block_size,
                                          cache_config.enable_prefix_caching, cache_config.num_cpu_blocks,
                                          cache_config.enable_block_sharing,
                                          sliding_window=cache_config.sliding_window)
        self.kv_leases = KVLeases(self.block_manager, config.kv_lease_s)
        self.key = order_key(config.scheduling_policy)
        if config.fairness not in FAIRNESS_MODES:
            raise ValueError(f"fairness must be one of {FAIRNESS_MODES}, got {config.fairness!r}")
        self.fairness = TokenFairness() if config.fairness == "tokens" else None
        self.waiting = WaitingQueue(self.key, self.fairness)
        self.swapped: deque[Request] = deque()  # sorted by key
        self.running: list[Request] = []  # sorted by key
        self.requests: dict[str, Request] = {}
        self.seqs: dict[int, tuple[Request, Sequence]] = {}
        self._finished_seq_ids: set[int] = set()
        self._seq_ids = itertools.count()
        self.beam = BeamSearcher(self)
        self.stats = SchedulerStats()
        self._constrained_rows: list[tuple[int, list[int]]] = []  # this step's (seq id, drafts) under a grammar
        self.overlap_grammar_bitmask = False  # set by the engine core when the runner is in this process
        self._errored: list[tuple[Request, str]] = []  # ended by their grammar in schedule(), reported by update

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    # ---- request lifecycle -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        so = request.sampling_params.structured_outputs
        if so is not None:
            if self.structured is None:
                raise ValueError("structured output needs the engine's tokenizer")
            self.structured.add(request.request_id, so)
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.seqs[seq.seq_id] = (request, seq)
        if self.fairness is not None:
            self.fairness.arrive(request)
        self.waiting.add(request)

    def abort_request(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self._finish_request(req, RequestStatus.FINISHED_ABORTED)
        return req

    def fail_all(self, error: str) -> list[EngineCoreOutput]:
        """The workers (and the KV they held) are gone: end every request with ``error``."""
        failed = list(self.requests.values())
        for req in failed:
            self._finish_request(req, RequestStatus.FINISHED_ERROR)
        self.kv_leases.release_all()
        self.block_manager.reset_prefix_cache()
        self._finished_seq_ids.clear()  # the new workers hold no sequence state
        return [self._core_output(req, EngineCoreOutput(req.request_id), error) for req in failed]

    def requeue_all(self, max_resumes: int) -> list[EngineCoreOutput]:
        """The workers, and the KV and swap space they held, are gone. Every request starts over from its tokens
        (prompt and output so far), recomputed on the new workers: seeded draws depend only on the seed and the
        output length, so the outputs are those it would have had. A request that already started over
        ``max_resumes`` times ends with an error instead."""
        failed, requeued = [], []
        for req in self.requests.values():
            if req.status != RequestStatus.WAITING:
                if req.num_resumes >= max_resumes:
                    failed.append(req)
                    continue
                req.num_resumes += 1
            for seq in req.live_seqs:
                self.block_manager.free(seq)
                _reset_for_recompute(seq)
            req.status = RequestStatus.WAITING
            requeued.append(req)
        error = f"the model workers failed under this request {max_resumes + 1} times"
        for req in failed:
            self._finish_request(req, RequestStatus.FINISHED_ERROR)
        self.running.clear()
        self.swapped.clear()
        self.waiting.replace_all(requeued)
        self.kv_leases.release_all()
        self.block_manager.reset_prefix_cache()
        self._finished_seq_ids.clear()  # the new workers hold no sequence state
        return [self._core_output(req, EngineCoreOutput(req.request_id), error) for req in failed]

    def stop_sequence(self, req: Request, index: int) -> None:
        """Finish one completion early (a stop string matched in the engine's detokenizer)."""
        seq = next((s for s in req.seqs if s.index == index), None)
        if seq is None or seq.finished or req.finished:
            return
        self.finish_seq(req, seq, RequestStatus.FINISHED_STOPPED)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _release(self, seq: Sequence, status: RequestStatus) -> None:
        self.block_manager.free(seq)
        if self.structured is not None:
            self.structured.free(seq.seq_id)
        seq.status = status
        self._finished_seq_ids.add(seq.seq_id)
        self.seqs.pop(seq.seq_id, None)

    def finish_seq(self, req: Request, seq: Sequence, status: RequestStatus) -> None:
        """End one sequence; the request ends with its last live sequence."""
        if status == RequestStatus.FINISHED_REMOTE_DECODE:  # its full prompt blocks, cached by now
            held = list(itertools.takewhile(lambda b: b != NULL_BLOCK, seq.block_table[:len(seq.block_hashes)]))
            self.kv_leases.hold(req.request_id, held, time.monotonic())
        self._release(seq, status)
        if not req.live_seqs and not req.finished:
            self._finish_request(req, status)

    def drop_seq(self, req: Request, seq: Sequence) -> None:
        """Remove a sequence that will not be returned (a pruned beam)."""
        self.finish_seq(req, seq, RequestStatus.FINISHED_ABORTED)
        req.seqs.remove(seq)

    def _finish_request(self, req: Request, status: RequestStatus) -> None:
        if self.structured is not None:
            self.structured.abandon(req.request_id)
        for seq in req.live_seqs:
            self._release(seq, status)
        for queue in (self.waiting, self.running, self.swapped):
            if req in queue:
                queue.remove(req)
        if self.fairness is not None and not req.finished:
            self.fairness.leave(req)
        req.status = status
        self.requests.pop(req.request_id, None)

    def add_seq(self, req: Request, seq: Sequence) -> None:
        req.seqs.append(seq)
        self.seqs[seq.seq_id] = (req, seq)

    # ---- preemption --------------------------------------------------------------------------
    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        _drop_drafts(req)
        mode = self.config.preemption_mode
        if mode is None:
            mode = "swap" if len(req.live_seqs) > 1 else "recompute"  # nothing is shared before the fork
        if mode == "swap" and self._swap_out(req, out):
            self.swapped.append(req)
            self.swapped = deque(sorted(self.swapped, key=self.key))
        else:
            mode = "recompute"
            for seq in req.live_seqs:
                self.block_manager.free(seq)
                _reset_for_recompute(seq)
                self._finished_seq_ids.add(seq.seq_id)
            req.status = RequestStatus.WAITING
            self.waiting.add(req)
        req.num_preemptions += 1
        self.stats.num_preemptions[mode] += 1

    def _swap_out(self, req: Request, out: SchedulerOutput) -> bool:
        seqs = req.live_seqs
        pairs = self.block_manager.swap_out(seqs)
        if pairs is None:
            return False
        for seq in seqs:
            seq.status = RequestStatus.SWAPPED
            seq.num_sent_tokens = 0
            self._finished_seq_ids.add(seq.seq_id)
        out.blocks_to_swap_out.extend(pairs)
        self.stats.num_swapped_out_blocks += len(pairs)
        req.status = RequestStatus.SWAPPED
        return True

    def _swap_in(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Bring a swapped request back if its blocks and its next ``n`` tokens fit."""
        pairs = self.block_manager.swap_in(req.live_seqs, n)
        if pairs is None:
            return False
        for seq in req.live_seqs:
            seq.status = RequestStatus.RUNNING
        out.blocks_to_swap_in.extend(pairs)
        self.stats.num_swapped_in_blocks += len(pairs)
        req.status = RequestStatus.RUNNING
        return True

    # ---- scheduling --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.structured is not None:
            self._fail_grammars()
        step = _StepBudget(self.config.max_num_batched_tokens)
        spec = self.spec_config
        if spec is not None and sum(len(r.live_seqs) for r in self.running) > spec.max_batch_size:
            spec = None  # a batch this wide keeps the hardware busy: drafts would cost more than they save

        now = time.monotonic()
        if self.kv_leases.leases:
            self.kv_leases.expire(now)
        head = self._make_way_by_priority(out) if self.config.scheduling_policy == "priority" else None
        held = self._held_decodes(now)
        self._schedule_running(out, step, spec, now, held, held_only=False)

        if not step.preempted:
            while self.swapped and step.tokens > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.swapped[0]
                if head is not None and head.priority < req.priority:
                    break  # only a better priority lets a waiting request go before a swapped one
                n = self._admit_tokens(req, step.tokens)
                if n <= 0 or not self._swap_in(req, n, out):
                    break
                self.swapped.popleft()
                if not self._allocate(req, n, out):
                    raise RuntimeError("swap-in reserved too few blocks")
                bisect.insort(self.running, req, key=self.key)
                req.last_scheduled_time = now
                step.tokens -= self._schedule_request(out, req, n)

        # In order, except that a request whose grammar is still compiling lets the ones behind it go first.
        for req in self.waiting.admission_order():
            if (step.tokens <= 0 or step.preempted or len(self.running) >= self.config.max_num_seqs
                    or (self.swapped and self.swapped[0].priority <= req.priority)):
                break
            if not self._grammar_ready(req):
                continue
            if not self._admit(req, step.tokens, out):
                break
            req.last_scheduled_time = now
            step.prefilling = True
            step.tokens -= self._schedule_request(out, req, self._admit_tokens(req, step.tokens))
        if held and not step.prefilling:  # no prompt could start after all (blocks, grammars compiling): decode now
            self._schedule_running(out, step, spec, now, held, held_only=True)

        if self._constrained_rows:
            out.grammar_bitmask, out.grammar_rows = self.structured.bitmask(self._constrained_rows,
                                                                            self.overlap_grammar_bitmask)
            self._constrained_rows = []
        out.finished_seq_ids, self._finished_seq_ids = self._finished_seq_ids, set()
        self.stats.num_scheduled_tokens += out.total_num_scheduled_tokens
        self._record_stats()
        return out

    def _grammar_ready(self, req: Request) -> bool:
        return self.structured is None or self.structured.ready(req.request_id)

    def _make_way_by_priority(self, out: SchedulerOutput) -> Request | None:
        """Running requests of a worse priority, the worst first, make way for the waiting requests ahead of them,
        as many as can start this step: each needs a sequence slot and the blocks for its first chunk (its cached
        prefix aside) beside the running requests' next tokens. Returns the first waiting request whose grammar
        (if any) is ready: nothing swapped of a worse priority goes before it."""
        if not self.waiting:
            return None
        bm = self.block_manager
        # Each running request's blocks for its next tokens, once a step: preempting one does not change another's.
        next_blocks = {r.request_id: bm.group_blocks_needed(r.live_seqs, 1) for r in self.running}
        budget, slots, blocks = self.config.max_num_batched_tokens, 0, sum(next_blocks.values())
        first = None
        for req in self.waiting.admission_order():
            if not self._grammar_ready(req):
                continue
            first = first or req
            n = self._admit_tokens(req, budget)
            if n <= 0:
                break
            need = bm.group_blocks_needed(req.live_seqs, n)
            while (self.running and self.running[-1].priority > req.priority
                   and self._short_of_room(slots + 1, blocks + need)):
                victim = self.running[-1]
                self._preempt(victim, out)
                blocks -= next_blocks.pop(victim.request_id)
            if self._short_of_room(slots + 1, blocks + need):
                break
            budget, slots, blocks = budget - n, slots + 1, blocks + need
        return first

    def _short_of_room(self, slots: int, blocks: int) -> bool:
        """Whether ``slots`` more sequences beside the running ones, and ``blocks`` more blocks (the running
        requests' next tokens included), do not fit."""
        if len(self.running) + slots > self.config.max_num_seqs:
            return True
        return self.block_manager.num_free_blocks - blocks < self.block_manager.watermark_blocks

    def _held_decodes(self, now: float) -> set[str]:
        """Running decodes to hold back this step so that prompts prefill first (lower TTFT under bursts, wider
        decode batches after), each for at most ``max_decode_stall_ms`` since it last ran."""
        limit = self.config.max_decode_stall_ms / 1e3
        if limit <= 0 or self.swapped:
            return set()
        decoding = [r for r in self.running if not _prefilling(r)]
        if len(decoding) == len(self.running) and not (self.waiting and len(self.running) < self.config.max_num_seqs):
            return set()  # no prompt to run first
        return {r.request_id for r in decoding if now - r.last_scheduled_time < limit}

    def _schedule_running(self, out: SchedulerOutput, step: _StepBudget, spec: SpeculativeConfig | None,
                          now: float, held: set[str], held_only: bool) -> None:
        """Schedule the running requests in order (the held decodes, or all but them), preempting the last ones
        when blocks run out."""
        i = 0
        while i < len(self.running) and step.tokens > 0:
            req = self.running[i]
            if (req.request_id in held) != held_only:
                i += 1
                continue
            if spec is not None:
                self._propose(req, spec, step.tokens)
            n = self._admit_tokens(req, step.tokens)
            if n <= 0:
                _drop_drafts(req)
                break
            if not self._allocate(req, n, out):
                step.preempted = True
                # The latest arrivals go first, but never one already in this step (a decode held back lets
                # later ones run before it).
                fits = False
                while not fits and self.running[-1] is not req and not _in_step(self.running[-1], out):
                    self._preempt(self.running[-1], out)
                    fits = self._allocate(req, n, out)
                if not fits:
                    self._preempt(req, out)
                    break
            if held and not step.prefilling:  # read only to decide whether the held decodes run after all
                step.prefilling = _prefilling(req)
            req.last_scheduled_time = now
            step.tokens -= self._schedule_request(out, req, n)
            i += 1

    def _fail_grammars(self) -> None:
        """End the waiting requests whose grammar failed to compile or timed out: they hold no KV blocks yet."""
        for request_id, error in self.structured.failures():
            req = self.requests[request_id]
            self._finish_request(req, RequestStatus.FINISHED_ERROR)
            self._errored.append((req, error))

    def _allocate(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        bm = self.block_manager
        seqs = req.live_seqs
        # One sequence (most requests): allocate_slots checks its need itself and changes nothing when short.
        if len(seqs) > 1 and bm.group_blocks_needed(seqs, n) > bm.num_free_blocks:
            return False
        for s in seqs:
            first_copy = len(out.blocks_to_copy)
            if not bm.allocate_slots(s, min(n, s.num_pending_tokens), out.blocks_to_copy):
                return False  # only a lone sequence gets here (a group's need was checked above)
            for _, dst in out.blocks_to_copy[first_copy:]:  # the workers must get the new table from there on
                s.num_sent_blocks = min(s.num_sent_blocks, s.block_table.index(dst))
        return True

    def _propose(self, req: Request, spec: SpeculativeConfig, budget: int) -> None:
        """n-gram drafts for a request's decoding sequences, within the budget and the request's limits."""
        seqs = req.live_seqs
        if req.beam_params is not None:
            return
        sp = req.sampling_params
        room = budget // len(seqs) - 1
        for s in seqs:
            if s.num_tokens - s.num_computed_tokens != 1:  # prefilling (or recomputing): no drafts
                continue
            k = min(spec.num_speculative_tokens, room, self.config.max_model_len - s.num_tokens - 1)
            if sp.max_tokens is not None:
                k = min(k, sp.max_tokens - s.num_output_tokens - 1)
            if k > 0:
                s.spec_token_ids = propose_ngram(s.token_ids, spec.prompt_lookup_min, spec.prompt_lookup_max, k)

    @staticmethod
    def _admit_tokens(req: Request, budget: int) -> int:
        """Tokens per sequence this step: a prefill chunk can be long; a request's sequences go together."""
        seqs = req.live_seqs
        if len(seqs) == 1:
            return min(seqs[0].num_pending_tokens, budget)
        return min(max(s.num_pending_tokens for s in seqs), budget // len(seqs))

    def _admit(self, req: Request, budget: int, out: SchedulerOutput) -> bool:
        """Move a waiting request to running if its first chunk fits; reuse cached blocks."""
        bm = self.block_manager
        seqs = req.live_seqs
        if req.sampling_params.prompt_logprobs is None:  # cached tokens would get no prompt logprobs
            for s in seqs:
                bm.take_prefix(s, bm.match_prefix(s, req.cache_salt))
        n = self._admit_tokens(req, budget)
        remaining = max(s.num_tokens - s.num_computed_tokens for s in seqs)
        fits = n > 0 and (self.config.enable_chunked_prefill or n == remaining)
        if not fits or not bm.can_admit(seqs, n, use_watermark=bool(self.running)):
            for s in seqs:
                bm.free(s)
                s.num_computed_tokens = 0
            return False
        self.waiting.remove(req)
        if self.structured is not None and req.sampling_params.structured_outputs is not None \
                and not self.structured.constrained(seqs[0].seq_id):
            self.structured.start(req.request_id, [(s.seq_id, s.token_ids[s.prompt_len:]) for s in seqs])
        cached = sum(s.num_computed_tokens for s in seqs)
        self.stats.prefix_cache_queries += sum(s.num_tokens for s in seqs)
        self.stats.prefix_cache_hits += cached
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
            req.num_cached_tokens = cached
        self._allocate(req, n, out)
        req.status = RequestStatus.RUNNING
        for s in seqs:
            s.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=self.key)
        return True

    def _schedule_request(self, out: SchedulerOutput, req: Request, n: int) -> int:
        seqs = req.live_seqs
        if len(seqs) == 1:
            return self._schedule_seq(out, req, seqs[0], min(n, seqs[0].num_pending_tokens))
        return sum(self._schedule_seq(out, req, s, min(n, s.num_pending_tokens)) for s in seqs)

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
                num_computed_tokens=seq.num_computed_tokens, num_kept_blocks=seq.num_sent_blocks))
        if seq.spec_token_ids:
            out.spec_token_ids[seq.seq_id] = list(seq.spec_token_ids)
            self.stats.spec_num_drafts += 1
            self.stats.spec_num_draft_tokens += len(seq.spec_token_ids)
        seq.num_sent_tokens = seq.num_tokens
        seq.num_sent_blocks = len(seq.block_table)
        seq.num_computed_tokens += n
        if (self.structured is not None and self.structured.constrained(seq.seq_id)
                and seq.num_computed_tokens == seq.num_tokens + len(seq.spec_token_ids)):  # it samples this step
            self._constrained_rows.append((seq.seq_id, seq.spec_token_ids))
        best_of = req.sampling_params.best_of
        if best_of > 1 and len(req.seqs) == 1 and seq.num_computed_tokens == seq.num_tokens == seq.prompt_len:
            # The prompt's first sample: the other best_of - 1 completions fork from it, sharing its blocks.
            out.fork_seeds[seq.seq_id] = [child_seed(seq.seed, j) for j in range(1, best_of)]
        out.num_scheduled_tokens[seq.seq_id] = n
        out.total_num_scheduled_tokens += n
        if self.fairness is not None:
            self.fairness.charge(req, n)
        return n

    def _record_stats(self) -> None:
        bm = self.block_manager
        used = bm.num_blocks - bm.num_free_blocks
        st = self.stats
        st.num_steps += 1
        st.peak_blocks_used = max(st.peak_blocks_used, used)
        if used:
            bs = self.block_size
            seqs = [s for r in self.running for s in r.live_seqs]
            if sum(len(s.block_table) for s in seqs) == used and \
                    all(s.num_computed_tokens > (len(s.block_table) - 1) * bs for s in seqs):
                # Every used block is a running sequence's, so equal counts mean none is held twice; with only
                # the last block of each partly filled, the tokens are counted per sequence.
                tokens = sum(min(len(s.block_table) * bs, s.num_computed_tokens) for s in seqs)
            else:  # distinct blocks and the tokens they hold: a block shared by forks counts once
                tokens = sum({b: min(bs, s.num_computed_tokens - i * bs)
                              for s in seqs for i, b in enumerate(s.block_table) if b != NULL_BLOCK}.values())
            st.waste_sum += max(0.0, 1.0 - tokens / (used * bs))

    # ---- results -----------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply a step's results; one output per request that got tokens, prompt logprobs or finished."""
        bm = self.block_manager
        for seq_id in sched.num_scheduled_tokens:
            if seq_id in self.seqs and seq_id not in sched.spec_token_ids:  # those after acceptance, below
                req, seq = self.seqs[seq_id]
                bm.cache_full_blocks(seq, req.cache_salt)
        touched: dict[str, tuple[Request, EngineCoreOutput]] = {}

        def output_of(req: Request) -> EngineCoreOutput:
            if req.request_id not in touched:
                touched[req.request_id] = (req, EngineCoreOutput(req.request_id))
            return touched[req.request_id][1]

        for seq_id, plps in result.prompt_logprobs.items():
            if seq_id not in self.seqs:
                continue
            req, seq = self.seqs[seq_id]
            # Entry j is prompt position start + j; after a recompute, the ones already out are not sent again.
            start = seq.num_computed_tokens - sched.num_scheduled_tokens[seq_id]
            new = plps[max(0, req.num_prompt_logprobs - start):]
            if new:
                out = output_of(req)
                out.prompt_logprobs = (out.prompt_logprobs or []) + new
                req.num_prompt_logprobs = start + len(plps)
            if seq.num_computed_tokens >= seq.prompt_len:
                req.prompt_logprobs_done = True
        if sched.fork_seeds or sched.spec_token_ids:  # a sequence may have several rows
            samples: dict[int, list[int]] = {}
            for k, seq_id in enumerate(result.seq_ids):
                samples.setdefault(seq_id, []).append(k)
            rows_of = samples.items()
        else:
            rows_of = ((seq_id, [k]) for k, seq_id in enumerate(result.seq_ids))
        for seq_id, rows in rows_of:
            if seq_id not in self.seqs:  # aborted while the step ran
                continue
            req, seq = self.seqs[seq_id]
            out = output_of(req)
            if req.beam_params is not None:
                self.beam.record(req, seq, result, rows[0])
                continue
            targets = [seq]
            for seed in sched.fork_seeds.get(seq_id, []):  # rows 1.. are the forked completions' first samples
                child = seq.fork(self.next_seq_id(), req.next_seq_index, seed)
                req.next_seq_index += 1
                bm.fork(seq, child)
                if self.structured is not None:
                    self.structured.fork(seq.seq_id, child.seq_id)
                self.add_seq(req, child)
                targets.append(child)
            drafts = sched.spec_token_ids.get(seq_id)
            if drafts is None:
                for target, k in zip(targets, rows):
                    self._append(req, target, result, k, out)
                continue
            for k in self._accept(req, seq, drafts, rows, result):
                self._append(req, seq, result, k, out)
                if seq.finished:  # a stop token among the accepted drafts: the rest is dropped
                    break
        for req in self.beam.step_done():
            output_of(req)
        errored, self._errored = self._errored, []
        return ([self._core_output(req, out) for req, out in touched.values()]
                + [self._core_output(req, EngineCoreOutput(req.request_id, invalid_request=True), error)
                   for req, error in errored])

    def _accept(self, req: Request, seq: Sequence, drafts: list[int], rows: list[int],
                result: ModelRunnerOutput) -> list[int]:
        """The rows whose samples the sequence keeps: the drafts its own samples confirm, then the first sample
        after them. A deterministic draft kept exactly when the row's own sample equals it is rejection sampling
        with draft probability 1: greedy and seeded outputs are the ones plain decoding gives. The KV of the rest
        is dropped, and its blocks released."""
        accepted = 0
        while accepted < len(drafts) and result.sampled_token_ids[rows[accepted]] == drafts[accepted]:
            accepted += 1
        st = self.stats
        st.spec_num_accepted_tokens += accepted
        st.spec_accepted_per_pos.extend([0] * (len(drafts) - len(st.spec_accepted_per_pos)))
        for pos in range(accepted):
            st.spec_accepted_per_pos[pos] += 1
        seq.num_computed_tokens -= len(drafts) - accepted
        seq.spec_token_ids = []
        self.block_manager.trim(seq)
        seq.num_sent_blocks = min(seq.num_sent_blocks, len(seq.block_table))
        self.block_manager.cache_full_blocks(seq, req.cache_salt)
        return rows[: accepted + 1]

    @staticmethod
    def _core_output(req: Request, out: EngineCoreOutput, error: str | None = None) -> EngineCoreOutput:
        """Fill in what holds after the step: finish reasons, cumulative logprobs, beams, an error."""
        out.finished = req.finished
        out.num_cached_tokens = req.num_cached_tokens
        for s in req.seqs:
            if s.index in out.new_token_ids or s.finished:
                out.cumulative_logprobs[s.index] = s.cumulative_logprob
            if s.finished:
                out.finish_reasons[s.index] = (FINISH_REASONS[s.status], s.stop_reason)
        if req.finished and req.beam_params is not None:
            out.beams = list(req.beam_state.finished)
        if req.status == RequestStatus.FINISHED_ERROR:
            out.error = error or "the model workers failed while this request ran"
        return out

    def _append(self, req: Request, seq: Sequence, result: ModelRunnerOutput, k: int, out: EngineCoreOutput) -> None:
        token = result.sampled_token_ids[k]
        seq.token_ids.append(token)
        out.new_token_ids.setdefault(seq.index, []).append(token)
        if result.sampled_logprobs is not None:
            lp = result.sampled_logprobs[k]
            seq.cumulative_logprob += lp
            if req.sampling_params.logprobs is not None:
                out.new_logprobs.setdefault(seq.index, []).append(result.logprobs[k])
        status = self.check_stop(req, seq, token, self.config.max_model_len)
        if self.structured is not None and self.structured.constrained(seq.seq_id):
            complete = self.structured.accept(seq.seq_id, token)
            if (why := self.structured.error(seq.seq_id)) is not None:  # not a complete output: an error
                self.finish_seq(req, seq, RequestStatus.FINISHED_ERROR)
                if req.finished:
                    self._errored.append((req, f"structured_outputs: {why}"))
                return
            if complete and status is None:
                status = RequestStatus.FINISHED_STOPPED  # the grammar is complete: nothing may follow
        if status is None and req.remote_decode:
            status = RequestStatus.FINISHED_REMOTE_DECODE
        if status is not None:
            self.finish_seq(req, seq, status)

    @staticmethod
    def check_stop(req: Request, seq: Sequence, token: int, max_model_len: int) -> RequestStatus | None:
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


def _in_step(req: Request, out: SchedulerOutput) -> bool:
    return any(s.seq_id in out.num_scheduled_tokens for s in req.live_seqs)


def _prefilling(req: Request) -> bool:
    """A prompt (or a preempted sequence's recompute) still has tokens to run before its next sample."""
    return any(s.num_tokens - s.num_computed_tokens > 1 for s in req.live_seqs)


def _reset_for_recompute(seq: Sequence) -> None:
    """Back to waiting with nothing computed (its blocks already freed); it keeps its tokens."""
    seq.num_computed_tokens = 0
    seq.block_hashes = []
    seq.status = RequestStatus.WAITING
    seq.num_sent_tokens = 0
    seq.spec_token_ids = []


def _drop_drafts(req: Request) -> None:
    for seq in req.seqs:
        seq.spec_token_ids = []
