"""A worker: one TP rank's model shard, KV cache shard and model runner."""
from __future__ import annotations

import logging

import psutil
import torch

from pagedserve.common.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.scheduler.output import ModelRunnerOutput, NewSeqData, SchedulerOutput
from pagedserve.worker.kv_transfer import KVBlockData, read_blocks, write_blocks
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.parallel_state import init_tensor_parallel

logger = logging.getLogger(__name__)

CPU_KV_FRACTION = 0.2  # default share of available RAM for the CPU KV pool


def configured_kv_blocks(cc: CacheConfig, per_block: int) -> int | None:
    """The KV blocks the flags fix (``num_gpu_blocks_override``, ``kv_cache_memory``), else None (sized from memory)."""
    if cc.num_gpu_blocks_override:
        return cc.num_gpu_blocks_override
    if cc.kv_cache_memory is not None:
        return cc.kv_cache_memory // per_block
    return None


def cpu_kv_blocks(available: int, per_block: int, cc: CacheConfig, sc: SchedulerConfig) -> int:
    """A CPU pool's blocks by default: ``CPU_KV_FRACTION`` of the RAM ``available`` once the weights are loaded, but
    never more than the scheduler could ever fill."""
    ceiling = sc.max_num_seqs * -(-sc.max_model_len // cc.block_size) + 1
    return min(int(available * CPU_KV_FRACTION) // per_block, ceiling)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None,
                 local_rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        if config.device == "cuda":
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        tp = config.parallel_config.tensor_parallel_size
        init_tensor_parallel(rank, tp, distributed_init_method, "nccl" if self.device.type == "cuda" else "gloo")
        torch.manual_seed(config.seed)
        self.model_runner = ModelRunner(config, self.device)

    def shutdown(self) -> None:
        """Free the weights and the KV cache now: an in-process engine's ``LLM`` object can outlive its shutdown, and a
        next engine in the same process sizes its cache from the memory left. The modules form reference cycles in
        the heap the engine core froze (``engine/gc_heap.py``), which no collection reaches: clearing their dicts
        breaks the cycles, so reference counting frees the tensors."""
        runner, self.model_runner = self.model_runner, None
        if runner is not None:
            for module in list(runner.model.modules()):
                module.__dict__.clear()

    def determine_num_blocks(self) -> int:
        cc, sc = self.config.cache_config, self.config.scheduler_config
        per_block = self.model_runner.kv_bytes_per_block()
        configured = configured_kv_blocks(cc, per_block)
        if configured is not None:
            return configured
        if self.device.type == "cuda":
            return self._profile_cuda_blocks(per_block)
        return cpu_kv_blocks(psutil.virtual_memory().available, per_block, cc, sc)

    def _profile_cuda_blocks(self, per_block: int) -> int:
        """Run a worst-case step on a scratch cache, then give the KV pool what is left."""
        sc, bs = self.config.scheduler_config, self.config.cache_config.block_size
        num_tokens = min(sc.max_num_batched_tokens, sc.max_model_len)
        blocks = -(-num_tokens // bs)
        runner = self.model_runner
        runner.init_kv_cache(blocks)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        dummy = NewSeqData(seq_id=-1, token_ids=[0] * num_tokens, prompt_len=num_tokens,
                           block_ids=list(range(blocks)), num_computed_tokens=0,
                           sampling_params=SamplingParams(max_tokens=1), seed=0)
        runner.execute_model(SchedulerOutput(scheduled_new_seqs=[dummy], num_scheduled_tokens={-1: num_tokens},
                                             total_num_scheduled_tokens=num_tokens))
        runner.states.clear()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - blocks * per_block
        runner.init_kv_cache(0)
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        free = total * self.config.cache_config.gpu_memory_utilization - peak
        return max(int(free) // per_block, 0)

    def num_cpu_blocks(self) -> int:
        return int(self.config.cache_config.swap_space * (1 << 30)) // self.model_runner.kv_bytes_per_block()

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        self.model_runner.init_kv_cache(num_blocks, num_cpu_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(sched)

    def read_kv_blocks(self, block_ids: list[int]) -> KVBlockData:
        return read_blocks(self.model_runner.k_caches, self.model_runner.v_caches, block_ids)

    def write_kv_blocks(self, block_ids: list[int], data: KVBlockData) -> int:
        return write_blocks(self.model_runner.k_caches, self.model_runner.v_caches, block_ids, data)
