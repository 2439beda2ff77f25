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
