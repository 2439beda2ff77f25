"""The engine core: scheduler + executor, in token ids. The Ray scheduler actor hosts one of these."""
from __future__ import annotations

import copy
import itertools
import logging
import random
import time
from dataclasses import dataclass

from pagedserve.config import EngineConfig
from pagedserve.engine.core_output import EngineCoreOutput, make_core_output
from pagedserve.engine.gc_heap import freeze_gc_heap
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.scheduler.request import Request, Sequence
from pagedserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1


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
    def __init__(self, config: EngineConfig, executor_cls=None) -> None:
        if executor_cls is None:
            pc = config.parallel_config
            if pc.tensor_parallel_size > 1 or pc.distributed_executor_backend == "ray":
                from pagedserve.cluster.ray_executor import RayExecutor

                def executor_cls(cfg):
                    return RayExecutor(cfg, pc.ray_address)
            else:
                from pagedserve.worker.executor import UniProcExecutor as executor_cls
        self.config = config
        self.max_model_len = config.scheduler_config.max_model_len
        self.vocab_size = config.model_config.vocab_size
        self._executor_cls = executor_cls
        self.executor = executor_cls(config)
        num_blocks = self.executor.determine_num_blocks()
        bs = config.cache_config.block_size
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache; raise kv_cache_memory or gpu_memory_utilization")
        # Swapping more than the device pool holds cannot help.
        num_cpu_blocks = min(self.executor.num_cpu_blocks(), num_blocks)
        config.cache_config.num_blocks = num_blocks
        config.cache_config.num_cpu_blocks = num_cpu_blocks
        self.executor.init_kv_cache(num_blocks, num_cpu_blocks)
        logger.info("KV cache: %d blocks = %d tokens (+ %d CPU swap blocks)", num_blocks, num_blocks * bs,
                    num_cpu_blocks)
        self.scheduler = Scheduler(config.scheduler_config, num_blocks, bs,
                                   config.cache_config.enable_prefix_caching, num_cpu_blocks,
                                   config.cache_config.enable_block_sharing)
        self._arrivals = itertools.count()
        self._rng = random.Random(config.seed)
        self.last_step: StepStats | None = None
        self.num_worker_restarts = 0
        freeze_gc_heap()

    def prepare_params(self, params: SamplingParams | None) -> SamplingParams:
        """A checked copy with the model's EOS ids as stop tokens (unless ignore_eos)."""
        params = copy.copy(params) if params is not None else SamplingParams()
        params.verify()
        params.all_stop_token_ids = set() if params.ignore_eos else set(self.config.model_config.eos_token_ids)
        return params

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams | BeamSearchParams | None):
        """Validate a request and return the params it will run with; raise ValueError otherwise."""
        if isinstance(params, BeamSearchParams):
            self.validate(prompt_token_ids, self.beam_sampling_params(params), params.beam_width)
            return params
        params = self.prepare_params(params)
        self.validate(prompt_token_ids, params)
        return params

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, num_seqs: int | None = None) -> None:
        """Raise ValueError for a request that cannot run; nothing is allocated yet."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if params.max_tokens is None:
            if n >= self.max_model_len:
                raise ValueError(f"prompt of {n} tokens leaves no room within max_model_len {self.max_model_len}")
        elif n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} exceeds "
                f"max_model_len {self.max_model_len}")
        total = n + (params.max_tokens if params.max_tokens is not None else self.max_model_len - n)
        need = -(-total // self.scheduler.block_size) * (num_seqs or params.best_of)
        if need > self.scheduler.block_manager.num_blocks:
            raise ValueError(f"request needs up to {need} KV blocks but the cache holds only "
                             f"{self.scheduler.block_manager.num_blocks}; lower max_tokens or raise kv_cache_memory")
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids outside the vocabulary: {bad_stop}")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs must be at most the vocabulary size {self.vocab_size}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.vocab_size:
            raise ValueError(f"prompt_logprobs must be at most the vocabulary size {self.vocab_size}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | BeamSearchParams,
                    cache_salt: str | None = None) -> Request:
        """Queue a request; ``BeamSearchParams`` make it a beam search of ``beam_width`` beams."""
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        beam = params if isinstance(params, BeamSearchParams) else None
        params = self.check_request(prompt_token_ids, params)
        if beam is not None:
            params = self.beam_sampling_params(beam)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(seq_id=self.scheduler.next_seq_id(), index=0, token_ids=list(prompt_token_ids),
                       prompt_len=len(prompt_token_ids), seed=base_seed & _SEED_MASK)
        req = Request(request_id, list(prompt_token_ids), params, [seq], arrival_index=next(self._arrivals),
                      cache_salt=cache_salt, beam_params=beam)
        if beam is not None:
            req.beam_state = self.scheduler.beam.init_state(req, set(self.config.model_config.eos_token_ids))
        self.scheduler.add_request(req)
        return req

    def beam_sampling_params(self, bp: BeamSearchParams) -> SamplingParams:
        """The per-beam step: greedy, returning enough top logprobs to rank all continuations."""
        eos = 0 if bp.ignore_eos else len(self.config.model_config.eos_token_ids)
        k = min(max(2, 1 + eos) * bp.beam_width, self.vocab_size)
        return SamplingParams(temperature=0.0, max_tokens=bp.max_tokens, logprobs=k, ignore_eos=True)

    def get_stats(self) -> dict[str, float]:
        """Scheduler and KV-cache counters (the metrics exporter reads these)."""
        sched = self.scheduler
        bm, st = sched.block_manager, sched.stats
        return {
            "num_running": len(sched.running), "num_waiting": len(sched.waiting), "num_swapped": len(sched.swapped),
            "kv_blocks_total": bm.num_blocks, "kv_blocks_free": bm.num_free_blocks, "kv_usage": bm.usage(),
            "kv_blocks_shared": bm.num_shared_blocks(), "copy_on_write": bm.num_copy_on_write,
            "prefix_cache_queries": st.prefix_cache_queries, "prefix_cache_hits": st.prefix_cache_hits,
            "preemptions_recompute": st.num_preemptions["recompute"], "preemptions_swap": st.num_preemptions["swap"],
            "swapped_in_blocks": st.num_swapped_in_blocks, "swapped_out_blocks": st.num_swapped_out_blocks,
            "scheduled_tokens": st.num_scheduled_tokens, "steps": st.num_steps,
            "num_worker_restarts": self.num_worker_restarts,
        }

    def reset_prefix_cache(self) -> None:
        self.scheduler.block_manager.reset_prefix_cache()

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
            return []
        num_running = len(self.scheduler.running)
        t1 = time.perf_counter()
        try:
            result = self.executor.execute_model(sched)
        except Exception as e:
            if type(e).__name__ != "WorkerFailedError":
                raise
            logger.error("%s; failing in-flight requests and rebuilding the worker group", e)
            return self._recover()
        t2 = time.perf_counter()
        updates = self.scheduler.update_from_output(sched, result, self.max_model_len)
        outputs = [make_core_output(u) for u in updates]
        self.last_step = StepStats(num_running, sched.total_num_scheduled_tokens, t1 - t0, t2 - t1,
                                   time.perf_counter() - t2, result.timings)
        return outputs

    def _recover(self) -> list[EngineCoreOutput]:
        """Fail every in-flight request, then replace the whole TP group with fresh workers."""
        updates = [make_core_output(u) for u in self.scheduler.fail_all()]
        self.executor.shutdown()
        self.executor = self._executor_cls(self.config)
        cc = self.config.cache_config
        self.executor.init_kv_cache(cc.num_blocks, cc.num_cpu_blocks)
        self.num_worker_restarts += 1
        return updates

    def shutdown(self) -> None:
        self.executor.shutdown()
