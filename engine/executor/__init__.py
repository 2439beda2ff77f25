"""Executors run one scheduler step on every model worker: in this process, or on tensor-parallel Ray actors."""
from pagedserve.engine.executor.base import Executor, RayPlacement
from pagedserve.engine.executor.factory import create_executor

__all__ = ["Executor", "RayPlacement", "create_executor"]
