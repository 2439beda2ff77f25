"""The in-process executor: one worker, no tensor parallelism."""
from __future__ import annotations

from pagedserve.common.config import EngineConfig
from pagedserve.engine.executor.base import Executor
from pagedserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagedserve.worker.kv_transfer import KVBlockData
from pagedserve.worker.worker import Worker


class UniProcExecutor(Executor):
    in_process = True

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("the in-process executor runs tensor_parallel_size=1 only; "
                             "larger sizes run on the Ray executor")
        self.worker = Worker(config)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def num_cpu_blocks(self) -> int:
        return self.worker.num_cpu_blocks()

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks, num_cpu_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def read_kv_blocks(self, block_ids: list[int]) -> list[KVBlockData]:
        return [self.worker.read_kv_blocks(block_ids)]

    def write_kv_blocks(self, block_ids: list[int], data: list[KVBlockData]) -> int:
        return self.worker.write_kv_blocks(block_ids, data[0])

    def shutdown(self) -> None:
        self.worker.shutdown()
