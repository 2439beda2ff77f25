"""The one place that picks an executor for a configuration."""
from __future__ import annotations

from pagedserve.common.config import EngineConfig
from pagedserve.engine.executor.base import Executor, RayPlacement
from pagedserve.engine.executor.uniproc import UniProcExecutor

try:  # Ray runs tensor parallelism; one process (offline, one GPU) needs no Ray installed.
    from pagedserve.engine.executor.ray_executor import RayExecutor
except ModuleNotFoundError as e:
    if e.name != "ray":
        raise
    RayExecutor = None


def create_executor(config: EngineConfig, placement: RayPlacement | None = None) -> Executor:
    """Ray worker actors when ``distributed_executor_backend`` resolved to "ray" (tensor parallelism), else the
    model in this process."""
    if config.parallel_config.distributed_executor_backend == "ray":
        if RayExecutor is None:
            raise ImportError('distributed_executor_backend="ray" (tensor parallelism) needs Ray: pip install ray')
        return RayExecutor(config, placement)
    return UniProcExecutor(config)
