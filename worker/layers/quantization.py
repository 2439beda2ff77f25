"""Weight-only int8 (``quantization="int8"``): after loading, every linear layer's weight (each rank's own shard),
the LM head's included, becomes int8 ``[N, K]`` with fp32 per-output-channel scales ``weight_scale [N]``
(``torch_ref.quantize_int8``), replacing the full-precision weight. A LM head tied to the input embedding gets an
int8 weight of its own: the embedding keeps the full-precision rows it looks up. What stays unquantized: embeddings,
norms, and MoE routers (a tiny matrix whose rounding would move tokens between experts); MoE experts are quantized
like any linear. The kernel backend's ``linear`` runs the layers (the int8 panel GEMM on CPU, the torch reference
elsewhere)."""
from __future__ import annotations

import logging

import torch
from torch import nn

from pagedserve.kernels.torch_ref import quantize_int8
from pagedserve.worker.layers.embedding import ParallelLMHead
from pagedserve.worker.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedserve.worker.layers.moe import SparseMoeBlock

logger = logging.getLogger(__name__)

LINEAR_TYPES = (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


def quantize_linears(model: nn.Module, method: str) -> int:
    """Quantize every linear layer of a loaded ``model`` in place; returns how many."""
    if method != "int8":
        raise ValueError(f"unknown quantization method {method!r}")
    routers = {id(m.gate) for m in model.modules() if isinstance(m, SparseMoeBlock)}
    # a weight tied to an embedding stays allocated there, for its lookups: not freed by quantizing
    tied = {p.data_ptr() for m in model.modules() if not isinstance(m, LINEAR_TYPES)
            for p in m.parameters(recurse=False)}
    freed = kept = after = count = 0
    for module in model.modules():
        if not isinstance(module, LINEAR_TYPES) or id(module) in routers:
            continue
        w = module.weight.detach()
        q, scale = quantize_int8(w)
        if w.data_ptr() in tied:
            kept += w.numel() * w.element_size()
        else:
            freed += w.numel() * w.element_size()
        module.weight = nn.Parameter(q, requires_grad=False)
        module.weight_scale = nn.Parameter(scale, requires_grad=False)
        after += q.numel() + scale.numel() * 4
        count += 1
    logger.info("int8: quantized %d linear weights, %.1f MiB -> %.1f MiB%s", count, freed / 2**20, after / 2**20,
                f" (the tied embedding keeps its {kept / 2**20:.1f} MiB)" if kept else "")
    return count


def is_quantized(module: nn.Module) -> bool:
    return getattr(module, "weight_scale", None) is not None and module.weight.dtype == torch.int8
