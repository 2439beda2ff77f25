"""Tensor-parallel executor: one Ray actor per TP rank, all in one STRICT_PACK placement group.

Each step the scheduler's ``SchedulerOutput`` is put in the object store once and every rank reads it;
the ranks meet in all-reduce (gloo on CPU, NCCL on GPU) and rank 0 returns the sampled tokens.
"""
from __future__ import annotations

import logging
import os
import socket

import ray
import torch
from ray.dag import InputNode, MultiOutputNode
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedserve.common.config import EngineConfig
from pagedserve.common.errors import KVTransferError, WorkerFailedError
from pagedserve.engine.executor.base import Executor, RayPlacement
from pagedserve.engine.executor.ray_utils import ensure_ray, make_placement_group, rank_bundle, rank_cpus
from pagedserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagedserve.worker.kv_transfer import KVBlockData
from pagedserve.worker.worker import Worker

logger = logging.getLogger(__name__)


class RayWorker:
    """A TP rank: builds its Worker (model shard + KV cache shard) inside the actor process."""

    def __init__(self, config: EngineConfig, rank: int, num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        self.config, self.rank, self.worker = config, rank, None

    def pid(self) -> int:
        return os.getpid()

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def init_worker(self, init_method: str) -> None:
        self.worker = Worker(self.config, self.rank, init_method, local_rank=0)

    def execute_method(self, method: str, *args):
        """Call a ``Worker`` method in this rank (set-up calls; steps go through ``execute_model``)."""
        return getattr(self.worker, method)(*args)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        out = self.worker.execute_model(sched)
        return out if self.rank == 0 else None


class RayExecutor(Executor):
    """``use_compiled_graph``: broadcast through a Ray Compiled Graph (shared-memory channels) instead of
    plain actor calls. Its round trip is shorter, but its channels spin-wait on the cores the matmuls need, so by
    default it is used on GPUs only, where the host cores are idle."""

    def __init__(self, config: EngineConfig, placement: RayPlacement | None = None,
                 use_compiled_graph: bool | None = None) -> None:
        ensure_ray(config.parallel_config.ray_address)
        self.use_compiled_graph = config.device == "cuda" if use_compiled_graph is None else use_compiled_graph
        self.dag, self.workers = None, []
        tp = config.parallel_config.tensor_parallel_size
        gpu = config.device == "cuda"
        self.owns_pg = placement is None
        if placement is None:
            placement = RayPlacement(make_placement_group([rank_bundle(rank_cpus(tp, gpu), gpu)] * tp, "llm"))
        self.pg = placement.placement_group
        try:
            self._start_workers(config, placement.first_bundle, tp, gpu)
        except BaseException:
            self.shutdown()  # a rank that failed to load its shard: the next engine in this process needs the room
            raise

    def _start_workers(self, config: EngineConfig, first: int, tp: int, gpu: bool) -> None:
        cpu = self.pg.bundle_specs[first].get("CPU", 0.0)
        threads = max(1, (os.cpu_count() or 1) // tp)
        actor_cls = ray.remote(num_cpus=cpu, num_gpus=1 if gpu else 0)(RayWorker)
        self.workers = [
            actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=first + rank),
            ).remote(config, rank, threads)
            for rank in range(tp)]
        ip, port = ray.get([self.workers[0].node_ip.remote(), self.workers[0].free_port.remote()])
        ray.get([w.init_worker.remote(f"tcp://{ip}:{port}") for w in self.workers])

    def _all(self, method: str, *args):
        """A ``Worker`` method on every rank; their results in rank order."""
        return ray.get([w.execute_method.remote(method, *args) for w in self.workers])

    def determine_num_blocks(self) -> int:
        return min(self._all("determine_num_blocks"))  # every rank must hold every block

    def num_cpu_blocks(self) -> int:
        return min(self._all("num_cpu_blocks"))

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self._all("init_kv_cache", num_blocks, num_cpu_blocks)

    def _compile(self) -> None:
        # Compiled after init_kv_cache: from here on the actors run only this graph.
        with InputNode() as inp:
            dag = MultiOutputNode([w.execute_model.bind(inp) for w in self.workers])
        self.dag = dag.experimental_compile()

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        try:
            if self.use_compiled_graph:
                if self.dag is None:
                    self._compile()
                return ray.get(self.dag.execute(sched))[0]
            ref = ray.put(sched)  # serialized once, read by every rank
            return ray.get([w.execute_model.remote(ref) for w in self.workers])[0]
        except ray.exceptions.RayError as e:
            # The survivors are stuck in a collective with the dead rank: the group is torn down by the caller.
            raise WorkerFailedError(f"tensor-parallel worker failed: {type(e).__name__}: {e}") from e

    def read_kv_blocks(self, block_ids: list[int]) -> list[KVBlockData]:
        self._check_kv_access()
        return self._all("read_kv_blocks", block_ids)

    def write_kv_blocks(self, block_ids: list[int], data: list[KVBlockData]) -> int:
        self._check_kv_access()
        if len(data) != len(self.workers):
            raise KVTransferError(f"KV of {len(data)} ranks for {len(self.workers)} ranks")
        return min(ray.get([w.execute_method.remote("write_kv_blocks", block_ids, d)
                            for w, d in zip(self.workers, data)]))

    def _check_kv_access(self) -> None:
        if self.dag is not None:  # its actors run only the compiled graph
            raise KVTransferError("the workers run a compiled graph: their KV blocks cannot be read or written")

    def worker_pids(self) -> list[int]:
        return ray.get([w.pid.remote() for w in self.workers])

    def shutdown(self) -> None:
        """Kill the workers and release the placement group; safe to call twice, and after Ray shut down."""
        if not ray.is_initialized():
            self.workers, self.dag = [], None
            return
        for w in self.workers:
            ray.kill(w, no_restart=True)
        if self.dag is not None:
            try:
                self.dag.teardown(kill_actors=True)
            except Exception as e:  # the graph's actors may already be gone
                logger.debug("compiled graph teardown: %s", e)
            self.dag = None
        self.workers = []
        if self.owns_pg and self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
