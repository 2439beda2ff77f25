"""The engine core: scheduler + executor, in token ids. Offline it runs in the caller's process; when serving,
an engine-core actor on Ray hosts one per replica."""
from __future__ import annotations

import copy
import itertools
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass

from pagedserve.common.config import EngineConfig
from pagedserve.common.errors import DuplicateRequestError, EngineUnavailableError, WorkerFailedError
from pagedserve.common.outputs import EngineCoreOutput
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.engine.core_types import EngineCoreRequest, EngineInfo, EngineStats
from pagedserve.engine.executor import Executor, create_executor
from pagedserve.engine.gc_heap import freeze_gc_heap
from pagedserve.engine.kv_transfer import KVHandoff, seal, verified
from pagedserve.engine.tokenizer import guidance_tokenizer, load_tokenizer
from pagedserve.scheduler.kv_events import BlockHash, KVCacheSnapshot, KVEvent
from pagedserve.scheduler.request import Request, Sequence, child_seed
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1
WARMUP_ID = "__warmup__"
MAX_WORKER_FAILURES = 3  # worker-group failures a request survives (recomputed each time) before it ends with an error
REPEATED_FAILURES = 2  # the same step failure this many times in a row: the model is probed alone
GRAMMAR_IDLE_WAIT_S = 0.005  # an idle step's wait for a grammar compile (a new request waits at most this more)


def failure_signature(error: BaseException) -> str:
    """What a step failure was, as type and message of the model's own exception (a worker's, behind a Ray task
    error): equal for a deterministic failure. A worker's death names its process, so no two deaths are equal."""
    cause = error.__cause__ if isinstance(error, WorkerFailedError) and error.__cause__ is not None else error
    inner = getattr(cause, "cause", None)  # a Ray task error carries the worker's exception
    if isinstance(inner, BaseException):
        cause = inner
    return f"{type(cause).__name__}: {cause}"


@dataclass
class FailureStreak:
    """The same step failure, counted while it repeats with no step succeeding between."""

    last: str | None = None
    count: int = 0

    def add(self, error: BaseException) -> int:
        sig = failure_signature(error)
        self.count = self.count + 1 if sig == self.last else 1
        self.last = sig
        return self.count

    def clear(self) -> None:
        self.last, self.count = None, 0


@dataclass
class StepStats:
    """Where one engine step's time went (seconds), for benchmarks and metrics."""

    num_running: int
    num_tokens: int
    schedule: float
    execute: float  # executor call, incl. the worker's prepare / forward / sample
    update: float
    worker: dict[str, float]


class EngineCore:
    """``executor_factory`` builds the executor, and builds it again after a worker failure. ``on_health`` (if given)
    hears ``(False, why)`` when the core stops being able to serve (the worker group is being rebuilt) and
    ``(True, "")`` when it can again."""

    def __init__(self, config: EngineConfig,
                 executor_factory: Callable[[EngineConfig], Executor] = create_executor,
                 on_health: Callable[[bool, str], None] | None = None) -> None:
        self.config = config
        self.on_health = on_health
        self.max_model_len = config.scheduler_config.max_model_len
        self.vocab_size = config.model_config.vocab_size
        self._executor_factory = executor_factory
        self.executor = executor_factory(config)
        try:
            self.scheduler = self._init_kv_cache_and_scheduler()
        except BaseException:
            self.executor.shutdown()  # workers, placement group and KV cache go before the error does
            raise
        self._arrivals = itertools.count()
        self._rng = random.Random(config.seed)
        self.last_step: StepStats | None = None
        self.num_requests = 0
        self.num_worker_restarts = 0
        self.dead = False  # set when the workers are gone and could not be rebuilt
        # Set when the model fails every step the same way, a request of its own included: it takes no requests.
        self.failed: str | None = None
        self._streak = FailureStreak()
        self._probing = False  # running the warm-up request alone to see whether the model can run at all
        freeze_gc_heap()

    def _init_kv_cache_and_scheduler(self) -> Scheduler:
        config, cc = self.config, self.config.cache_config
        num_blocks = self.executor.determine_num_blocks()
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache; raise kv_cache_memory or gpu_memory_utilization")
        # Swapping more than the device pool holds cannot help.
        cc.num_blocks = num_blocks
        cc.num_cpu_blocks = min(self.executor.num_cpu_blocks(), num_blocks)
        self.executor.init_kv_cache(cc.num_blocks, cc.num_cpu_blocks)
        logger.info("KV cache: %d blocks = %d tokens (+ %d CPU swap blocks)", num_blocks, num_blocks * cc.block_size,
                    cc.num_cpu_blocks)
        mc = config.model_config
        structured = StructuredOutputManager(
            lambda: guidance_tokenizer(load_tokenizer(mc.tokenizer), mc.vocab_size, mc.eos_token_ids), mc.vocab_size,
            config.structured_outputs_config)
        scheduler = Scheduler(config.scheduler_config, cc, config.speculative_config, structured)
        scheduler.overlap_grammar_bitmask = self.executor.in_process
        return scheduler

    def get_info(self) -> EngineInfo:
        mc, cc = self.config.model_config, self.config.cache_config
        return EngineInfo(model=mc.model, architecture=mc.architecture, dtype=str(mc.dtype).removeprefix("torch."),
                          max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                          eos_token_ids=tuple(mc.eos_token_ids),
                          tensor_parallel_size=self.config.parallel_config.tensor_parallel_size,
                          block_size=cc.block_size, num_kv_blocks=cc.num_blocks,
                          enable_prefix_caching=cc.enable_prefix_caching, limits=self.config.request_limits,
                          stream_interval=self.config.scheduler_config.stream_interval,
                          scheduling_policy=self.config.scheduler_config.scheduling_policy)

    def add_request(self, request: EngineCoreRequest) -> Request:
        """Queue a request the input processor made; beam_params make it a beam search; a resume state continues
        one that another engine ran (see ``ResumeState``)."""
        if self.failed is not None:
            raise EngineUnavailableError(f"this model replica failed: {self.failed}")
        if request.request_id in self.scheduler.requests:
            raise DuplicateRequestError(f"request id {request.request_id!r} is already running")
        params, resume, ids = request.sampling_params, request.resume, request.prompt_token_ids
        if resume is not None:
            base_seed = resume.seed
        else:
            base_seed = (params.seed if params.seed is not None else self._rng.getrandbits(63)) & _SEED_MASK
        seqs = [Sequence(seq_id=self.scheduler.next_seq_id(), index=0, token_ids=list(ids), prompt_len=len(ids),
                         seed=base_seed)]
        if resume is not None and resume.completions and request.beam_params is None:
            seqs = [Sequence(seq_id=self.scheduler.next_seq_id(), index=c.index, token_ids=ids + c.output_token_ids,
                             prompt_len=len(ids), seed=child_seed(base_seed, c.index),
                             cumulative_logprob=c.cumulative_logprob) for c in resume.completions]
        req = Request(request.request_id, list(ids), params, seqs, arrival_index=next(self._arrivals),
                      cache_salt=request.cache_salt, seed=base_seed, beam_params=request.beam_params,
                      priority=request.priority, tenant=request.tenant, remote_decode=request.do_remote_decode)
        if resume is not None:
            req.next_seq_index = max(params.best_of, *(s.index + 1 for s in seqs))
            req.num_prompt_logprobs = resume.num_prompt_logprobs
            req.prompt_logprobs_done = resume.num_prompt_logprobs >= len(ids) - 1
        if request.beam_params is not None:
            req.beam_state = self.scheduler.beam.init_state(req, set(self.config.model_config.eos_token_ids))
        self.scheduler.add_request(req)
        if request.request_id != WARMUP_ID:
            self.num_requests += 1
        return req

    def warmup(self) -> None:
        """Run one tiny request through the whole path (a prefill and a decode step: kernels built, caches touched);
        no-op while serving. Raises ``EngineUnavailableError`` with the model's error if the request fails."""
        if self.failed is None and self.has_unfinished_requests():
            return
        eos = self.config.model_config.eos_token_ids
        token = eos[0] if eos and 0 <= eos[0] < self.vocab_size else 0
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        self.add_request(EngineCoreRequest(WARMUP_ID, [token], params))
        while self.has_unfinished_requests():
            for out in self.step():
                if out.request_id == WARMUP_ID and out.error is not None:
                    raise EngineUnavailableError(f"the warm-up request failed: {self.failed or out.error}")

    def get_stats(self) -> EngineStats:
        """Scheduler and KV-cache state and counters (the metrics exporter reads these)."""
        sched = self.scheduler
        bm = sched.block_manager
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting), num_swapped=len(sched.swapped),
            kv_blocks_total=bm.num_blocks, kv_blocks_free=bm.num_free_blocks, kv_blocks_shared=bm.num_shared_blocks(),
            kv_usage=bm.usage(), copy_on_write=bm.num_copy_on_write, num_requests=self.num_requests,
            num_worker_restarts=self.num_worker_restarts,
            num_constrained_requests=sched.structured.num_constrained_requests, scheduler=copy.deepcopy(sched.stats),
            num_waiting_tokens=sum(len(r.prompt_token_ids) for r in sched.waiting),
            num_kv_leases=len(sched.kv_leases.leases), num_kv_leases_expired=sched.kv_leases.num_expired)

    def reset_prefix_cache(self) -> None:
        self.scheduler.block_manager.reset_prefix_cache()

    def take_kv_events(self) -> list[KVEvent]:
        """Prefix-cache blocks stored and evicted since the last call (none are recorded before the first call, so
        an engine nobody drains keeps no list)."""
        return self.scheduler.block_manager.take_kv_events()

    def kv_snapshot(self) -> KVCacheSnapshot:
        return KVCacheSnapshot(self.scheduler.block_manager.cached_block_hashes())

    # ---- KV handoff (engine/kv_transfer.py) ---------------------------------------------------------------------
    def num_cached_blocks(self, block_hashes: list[BlockHash]) -> int:
        """How many leading blocks of this chain this engine's prefix cache holds."""
        return len(self.scheduler.block_manager.cached_run(block_hashes))

    def read_kv(self, block_hashes: list[BlockHash]) -> KVHandoff:
        """The producer side: the KV of the leading run of these blocks this engine holds (maybe none), unsealed
        (``kv_transfer.seal`` it off the engine thread)."""
        bm = self.scheduler.block_manager
        blocks = bm.cached_run(block_hashes)
        ranks = self.executor.read_kv_blocks(blocks) if blocks else []
        return KVHandoff(block_hashes[:len(blocks)], bm.block_token_ids(blocks), ranks)

    def write_kv(self, handoff: KVHandoff, parent_hash: BlockHash | None) -> int:
        """The consumer side: write handed-off blocks, already ``kv_transfer.verified``, chained to the cached
        ``parent_hash``, into free blocks and the prefix cache; returns how many went in (none when the pool has no
        room to spare)."""
        bm = self.scheduler.block_manager
        blocks = bm.reserve(handoff.num_blocks) if handoff.num_blocks else []
        if not blocks:
            return 0
        written = 0
        try:
            written = self.executor.write_kv_blocks(blocks, handoff.ranks)
        finally:
            inserted = bm.insert_cached(blocks, handoff.block_hashes, handoff.token_ids, parent_hash, written)
        return inserted

    def export_kv(self, block_hashes: list[BlockHash]) -> KVHandoff:
        """``read_kv``, sealed (in process: the offline engine, the tests)."""
        return seal(self.read_kv(block_hashes))

    def import_kv(self, handoff: KVHandoff, parent_hash: BlockHash | None) -> int:
        """``write_kv`` of the blocks that pass their checksums."""
        return self.write_kv(verified(handoff), parent_hash)

    def release_kv(self, request_id: str) -> bool:
        """The producer side: the decode replica has the blocks (or gave up): stop holding them."""
        return self.scheduler.kv_leases.release(request_id)

    def expire_kv_leases(self) -> list[str]:
        """End the leases past their deadline (each step does too; this is for an engine with nothing to run)."""
        return self.scheduler.kv_leases.expire(time.monotonic())

    def abort_request(self, request_id: str) -> Request | None:
        return self.scheduler.abort_request(request_id)

    def stop_sequence(self, request_id: str, index: int) -> None:
        """End one completion early: a stop string matched where the text is made."""
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.scheduler.stop_sequence(req, index)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        self.last_step = None
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty and not (sched.finished_seq_ids or sched.blocks_to_swap_out):
            # Nothing can run until a grammar compiles: wait a moment for one rather than spin on the compile's CPU.
            self.scheduler.structured.wait_for_compile(GRAMMAR_IDLE_WAIT_S)
            return []
        num_running = len(self.scheduler.running)
        t1 = time.perf_counter()
        try:
            result = self.executor.execute_model(sched)
        except WorkerFailedError as e:
            if self._probing:
                raise
            logger.error("%s; rebuilding the worker group, the requests in flight start over on it", e)
            return self._recover(e)
        finally:
            if isinstance(sched.grammar_bitmask, Future):  # the matchers may not change while it is filled
                wait([sched.grammar_bitmask])
        t2 = time.perf_counter()
        self._streak.clear()
        outputs = self.scheduler.update_from_output(sched, result)
        self.last_step = StepStats(num_running, sched.total_num_scheduled_tokens, t1 - t0, t2 - t1,
                                   time.perf_counter() - t2, result.timings)
        return outputs

    def _recover(self, error: WorkerFailedError) -> list[EngineCoreOutput]:
        """Replace the whole TP group with fresh workers; the requests in flight start over from their tokens on it
        (recomputed), so they finish as they would have. Outputs only for the few whose retry budget is spent."""
        repeats = self._streak.add(error)
        if self.on_health is not None:
            self.on_health(False, f"rebuilding the model workers after: {error}")
        if repeats >= REPEATED_FAILURES:  # recomputing them would fail again: they end with the model's error
            outputs = self.scheduler.fail_all(f"the model failed {repeats} times in a row: {self._streak.last}")
        else:
            outputs = self.scheduler.requeue_all(MAX_WORKER_FAILURES)
        self.executor.shutdown()
        try:
            self.executor = self._executor_factory(self.config)
            cc = self.config.cache_config
            self.executor.init_kv_cache(cc.num_blocks, cc.num_cpu_blocks)
        except Exception as e:
            self.dead = True  # no workers to step on: the host of this core must restart it
            raise RuntimeError(f"could not rebuild the model workers: {e}") from e
        self.num_worker_restarts += 1
        if repeats >= REPEATED_FAILURES:
            self._probe()
        if self.failed is None and self.on_health is not None:
            self.on_health(True, "")
        return outputs

    def fail_step(self, error: Exception) -> list[EngineCoreOutput]:
        """A step raised in this process (the model's code, not a worker's death): its requests end with the
        error, and when the same error repeats the model is probed alone (see ``_probe``)."""
        outputs = self.scheduler.fail_all(f"engine step failed: {failure_signature(error)}")
        if not self._probing and self._streak.add(error) >= REPEATED_FAILURES:
            self._probe()
        return outputs

    def _probe(self) -> None:
        """Run the warm-up request alone: if it fails too, every step fails whatever it holds, so the core marks
        itself failed (it takes no more requests and tells ``on_health``); else the failure was the requests'."""
        self._probing = True
        try:
            self.warmup()
        except Exception as e:
            self.scheduler.fail_all(str(e))
            self.failed = self._streak.last or failure_signature(e)
            logger.error("the model fails every step the same way, a request of its own included: %s; this replica "
                         "takes no more requests", self.failed)
            if self.on_health is not None:
                self.on_health(False, self.failed)
        else:
            self._streak.clear()
        finally:
            self._probing = False

    def shutdown(self) -> None:
        self.executor.shutdown()
        self.scheduler.structured.shutdown()
