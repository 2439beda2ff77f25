"""The one executor interface the engine core talks to."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from pagedserve.common.errors import KVTransferError
from pagedserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagedserve.worker.kv_transfer import KVBlockData


class Executor(ABC):
    """Runs steps on the model workers (TP ranks). ``execute_model`` raises ``WorkerFailedError`` when a worker
    died; the engine core then replaces the whole executor."""

    in_process = False  # the runner shares the engine core's process (and may take Futures in SchedulerOutput)

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV-cache blocks every rank can hold."""

    @abstractmethod
    def num_cpu_blocks(self) -> int:
        """CPU swap blocks every rank can hold."""

    @abstractmethod
    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    def read_kv_blocks(self, block_ids: list[int]) -> list[KVBlockData]:
        """Every rank's KV of these blocks, in rank order (a KV handoff's producer side)."""
        raise KVTransferError(f"{type(self).__name__} cannot read KV blocks out")

    def write_kv_blocks(self, block_ids: list[int], data: list[KVBlockData]) -> int:
        """Rank i writes ``data[i]`` (another replica's rank i) into ``block_ids``; returns how many leading blocks
        every rank wrote."""
        raise KVTransferError(f"{type(self).__name__} cannot write KV blocks in")

    def worker_pids(self) -> list[int]:
        """Process ids of worker actors (none when the model runs in this process)."""
        return []


@dataclass
class RayPlacement:
    """Where a Ray executor's ranks go: bundles ``first_bundle ..`` of a placement group made by the caller (the
    engine-core actor sits in bundle 0 of its replica's group). Without one the executor makes its own group."""

    placement_group: object
    first_bundle: int = 0

