"""Linear layers sharded over the tensor-parallel group, each parameter with a ``weight_loader``.

Column-parallel layers split the output dim (no communication); row-parallel layers split the input
dim and all-reduce, adding the bias once after the reduction.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.worker.forward_context import current_backend
from pagedserve.worker.models.weights import as_lazy
from pagedserve.worker.parallel_state import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size


def divide(a: int, b: int, what: str = "size") -> int:
    if a % b:
        raise ValueError(f"{what} {a} is not divisible by tensor_parallel_size {b}")
    return a // b


def _param(*shape: int, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = loader
    return p


def _copy(dst: torch.Tensor, w) -> None:
    if tuple(w.shape) != tuple(dst.shape):
        raise ValueError(f"checkpoint shard shape {tuple(w.shape)} does not match {tuple(dst.shape)}")
    dst.copy_(w.load())


class ReplicatedLinear(nn.Module):
    packable = True  # worker.cpu.prepare_model may swap the weight for a packed copy (panels or oneDNN)

    def __init__(self, input_size: int, output_size: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = _param(output_size, input_size, loader=self.weight_loader)
        self.bias = _param(output_size, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight) -> None:
        _copy(param.data, as_lazy(loaded_weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return current_backend().linear(self, x, self.bias)


class ColumnParallelLinear(nn.Module):
    packable = True

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.output_size_per_partition = divide(output_size, self.tp_size, "output size")
        self.gather_output = gather_output
        self.weight = _param(self.output_size_per_partition, input_size, loader=self.weight_loader)
        self.bias = _param(self.output_size_per_partition, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight) -> None:
        n = param.shape[0]
        _copy(param.data, as_lazy(loaded_weight).narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = current_backend().linear(self, x, self.bias)
        return all_gather_last_dim(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked along the output dim (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        shard = as_lazy(loaded_weight).narrow(0, self.tp_rank * size, size)
        _copy(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused; KV heads are replicated when tp_size > num_kv_heads."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = True) -> None:
        tp = get_tp_size()
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp, "number of attention heads")
        if tp >= total_num_kv_heads:
            divide(tp, total_num_kv_heads, "(as number of KV heads)")
            self.num_kv_heads, self.kv_replicas = 1, tp // total_num_kv_heads
        else:
            self.num_kv_heads, self.kv_replicas = divide(total_num_kv_heads, tp, "number of KV heads"), 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp
        super().__init__(hidden_size, output_size, bias)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id: str) -> None:
        w = as_lazy(loaded_weight)
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        else:
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, rank = self.kv_size, self.tp_rank // self.kv_replicas
        _copy(param.data.narrow(0, offset, size), w.narrow(0, rank * size, size))


class RowParallelLinear(nn.Module):
    packable = True

    def __init__(self, input_size: int, output_size: int, bias: bool = True, reduce_results: bool = True) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size_per_partition = divide(input_size, self.tp_size, "input size")
        self.reduce_results = reduce_results
        self.weight = _param(output_size, self.input_size_per_partition, loader=self.weight_loader)
        self.bias = _param(output_size, loader=self.bias_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight) -> None:
        n = param.shape[1]
        _copy(param.data, as_lazy(loaded_weight).narrow(1, self.tp_rank * n, n))

    def bias_loader(self, param: nn.Parameter, loaded_weight) -> None:
        _copy(param.data, as_lazy(loaded_weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = current_backend().linear(self, x, None)
        if self.reduce_results:
            y = all_reduce(y)
        return y + self.bias if self.bias is not None else y
