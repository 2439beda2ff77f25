"""The tensor-parallel group this process belongs to (size 1 when not distributed)."""
from __future__ import annotations

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1


def init_tensor_parallel(rank: int, world_size: int, init_method: str | None, backend: str) -> None:
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, world_size
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


class LastDimGather:
    """``all_gather_last_dim`` into buffers kept across calls, for ``[rows, n]`` inputs of up to ``max_rows`` rows:
    the LM head gathers fp32 logits every step, tens of MB that a new tensor would fault in page by page each time
    (as the CPU backend's linear keeps its output). A result is valid until the next call."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._parts: torch.Tensor | None = None  # [tp, max_rows, n]: each rank's rows, contiguous
        self._out: torch.Tensor | None = None  # [max_rows, tp * n]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if _TP_SIZE == 1 or x.dim() != 2 or x.shape[0] > self.max_rows:
            return all_gather_last_dim(x)
        rows, n = x.shape
        if self._parts is None or self._parts.shape[2] != n or self._parts.dtype != x.dtype:
            self._parts = torch.empty(_TP_SIZE, self.max_rows, n, dtype=x.dtype, device=x.device)
            self._out = torch.empty(self.max_rows, _TP_SIZE * n, dtype=x.dtype, device=x.device)
        parts = [p[:rows] for p in self._parts]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1, out=self._out[:rows])
