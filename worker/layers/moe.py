"""Sparse mixture-of-experts MLP with expert parallelism over the tensor-parallel ranks.

Each rank holds whole experts (a contiguous range; counts differ by one when ``num_experts`` is not divisible by
the TP size) and loads only their tensors. Tokens are already replicated on every rank after attention's
all-reduce, so each rank runs its experts on the tokens routed to them and the partial outputs are summed with
one all-reduce of [tokens, hidden] per MoE layer: the same traffic as a row-parallel linear. An all-to-all
dispatch would only pay once tokens are sharded across ranks (data-parallel attention), which they are not here.

The kernel backend routes (``select_experts``) and runs the experts (``moe_experts``): on CPU with fp32 experts, or
bf16 ones where the CPU has AVX512-BF16, one C++ call per layer on weights packed at load (``kernels/cpu/moe.py``);
under Triton, two grouped-GEMM launches on the experts stacked at load (:func:`pack_moe_blocks`,
``kernels/triton/moe.py``); otherwise ``run_experts`` here, where the (token, expert) pairs are sorted
by expert, each local expert runs one GEMM on its contiguous slice, and the weighted results are put back in token
order and summed over the k choices: one Python iteration per local expert, none per token.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from pagedserve.kernels.backend import KernelBackend, LocalExperts
from pagedserve.worker.forward_context import current_backend
from pagedserve.worker.layers.activation import SiluAndMul
from pagedserve.worker.layers.linear import ReplicatedLinear
from pagedserve.worker.parallel_state import all_reduce, get_tp_rank, get_tp_size


def local_experts(num_experts: int, tp_rank: int, tp_size: int) -> range:
    """The experts rank ``tp_rank`` holds: a contiguous range, the first ``num_experts % tp_size`` ranks one more."""
    base, extra = divmod(num_experts, tp_size)
    start = tp_rank * base + min(tp_rank, extra)
    return range(start, start + base + (tp_rank < extra))


class MergedReplicatedLinear(ReplicatedLinear):
    """Gate and up projections of one expert stacked along the output dim, unsplit (the rank holds the expert)."""

    def __init__(self, input_size: int, output_sizes: list[int]) -> None:
        super().__init__(input_size, sum(output_sizes), bias=False)
        self.output_sizes = output_sizes

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id: int = 0) -> None:
        offset, size = sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]
        super().weight_loader(param.data.narrow(0, offset, size), loaded_weight)


class Expert(nn.Module):
    """One SwiGLU expert: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedReplicatedLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = ReplicatedLinear(intermediate_size, hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router (replicated) + this rank's experts. Parameters are named ``gate.weight`` and
    ``experts.<global expert id>.{gate_up_proj,down_proj}.weight``, so checkpoint names map one to one."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, round_weights: bool = False) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.round_weights = round_weights  # Qwen3-MoE rounds routing weights to the activation dtype, Mixtral not
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.expert_ids = local_experts(num_experts, get_tp_rank(), get_tp_size())
        self.experts = nn.ModuleDict({str(e): Expert(hidden_size, intermediate_size) for e in self.expert_ids})
        self.moe_panels: object | None = None  # the experts in a kernel's layout, once packed (then experts is empty)

    def loaded_experts(self) -> LocalExperts:
        experts = [self.experts[str(e)] for e in self.expert_ids]
        scaled = all(hasattr(e.gate_up_proj, "weight_scale") for e in experts)

        def weights(name: str, attr: str) -> list[torch.Tensor]:
            return [getattr(getattr(e, name), attr).detach() for e in experts]

        return LocalExperts(weights("gate_up_proj", "weight"), weights("down_proj", "weight"), self.expert_ids.start,
                            weights("gate_up_proj", "weight_scale") if scaled else None,
                            weights("down_proj", "weight_scale") if scaled else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = current_backend().select_experts(self.gate(x), self.top_k, self.renormalize)
        weights = routing.weights.to(x.dtype).float() if self.round_weights else routing.weights
        return all_reduce(current_backend().moe_experts(self, x, routing.experts, weights))

    def run_experts(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's share: sum over local experts e of ``weight[t, e] * expert_e(x[t])`` for the tokens t routed
        to e, grouped by expert (one GEMM per expert), summed over the k choices in fp32."""
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        token_of = order // self.top_k
        weight_of = weights.flatten()[order]
        bounds = torch.bincount(flat, minlength=self.num_experts).cumsum(0).tolist()
        grouped = torch.zeros(flat.numel(), x.shape[-1], dtype=torch.float32, device=x.device)
        for e in self.expert_ids:
            start, end = (bounds[e - 1] if e else 0), bounds[e]
            if start < end:  # index_select and slices, not x[idx] / index_add_: their parallel loops cost more here
                y = self.experts[str(e)](x.index_select(0, token_of[start:end]))
                grouped[start:end] = y.float() * weight_of[start:end, None]
        per_choice = grouped.index_select(0, order.argsort())  # back to (token, k) order
        return per_choice.view(-1, self.top_k, x.shape[-1]).sum(1).to(x.dtype)


def pack_moe_blocks(model: nn.Module, backend: KernelBackend) -> int:
    """Give each MoE block whose experts are still modules the backend's layout for them (:meth:`KernelBackend.
    pack_experts`), freeing the modules; returns how many blocks."""
    packed = 0
    for block in model.modules():
        if isinstance(block, SparseMoeBlock) and len(block.experts) and block.moe_panels is None:
            block.moe_panels = backend.pack_experts(block.loaded_experts())
            if block.moe_panels is not None:
                block.experts = nn.ModuleDict()
                packed += 1
    return packed


_EXPERT_PARAM = re.compile(r"^(.*\.experts)\.(\d+)\.")


def is_foreign_expert(model: nn.Module, name: str) -> bool:
    """Whether checkpoint tensor ``name`` (already renamed to our module path) belongs to an expert another rank
    holds, so this rank skips it without reading it."""
    m = _EXPERT_PARAM.match(name)
    return m is not None and m.group(2) not in model.get_submodule(m.group(1))
