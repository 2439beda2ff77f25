"""Every MoE layer's local experts packed, once after loading, for the fused CPU MoE kernel (``kernels/cpu/moe.py``):
where the fp32 panel GEMM is the CPU's linear (:func:`~pagedserve.worker.cpu.packing.panel_gemm_preferred`) and the
experts are fp32 (int8 or bf16 experts keep their per-expert linears). The panels replace the experts' weights; they
are bf16 where every expert value is a bf16 number (a bf16 checkpoint run in fp32, ``dtype="auto"`` on AVX2)."""
from __future__ import annotations

import logging

import torch
from torch import nn

from pagedserve.kernels.cpu.moe import exact_in_bf16, pack_experts
from pagedserve.worker.cpu.packing import panel_gemm_preferred
from pagedserve.worker.layers.moe import SparseMoeBlock

logger = logging.getLogger(__name__)


def pack_moe_experts(model: nn.Module, panels: bool | None = None) -> int:
    """Pack each MoE block's experts; returns how many blocks. ``panels``: as ``pack_linears``' (default: where
    the panel GEMM is preferred)."""
    if not (panel_gemm_preferred() if panels is None else panels):
        return 0
    dtypes: list[torch.dtype] = []
    for block in model.modules():
        if not isinstance(block, SparseMoeBlock) or len(block.experts) == 0:
            continue
        experts = [block.experts[str(e)] for e in block.expert_ids]
        gate_up = [e.gate_up_proj.weight.detach() for e in experts]
        down = [e.down_proj.weight.detach() for e in experts]
        if any(w.dtype != torch.float32 or w.device.type != "cpu" for w in gate_up + down):
            continue
        dtype = torch.bfloat16 if exact_in_bf16(gate_up + down) else torch.float32
        block.moe_panels = pack_experts(gate_up, down, block.expert_ids.start, dtype)
        block.experts = nn.ModuleDict()
        dtypes.append(dtype)
    if dtypes:
        logger.info("fused MoE: packed the experts of %d layers (%s)", len(dtypes),
                    ", ".join(sorted({str(d).removeprefix("torch.") for d in dtypes})))
    return len(dtypes)
