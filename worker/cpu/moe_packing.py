"""Every MoE layer's local experts packed, once after loading, for the fused CPU MoE kernels
(``kernels/cpu/moe.py``): fp32 experts where the fp32 panel GEMM is the CPU's linear
(:func:`~pagedserve.worker.cpu.packing.panel_gemm_preferred`), in bf16 panels where every expert value is a bf16
number (a bf16 checkpoint run in fp32, ``dtype="auto"`` on AVX2); bf16 experts, and weight-only int8 ones of a
bf16 model (``quantization="int8"``), where the bf16 kernel is built (AVX512-BF16); int8 experts of an fp32 model
keep their per-expert linears. The panels replace the experts' weights, on huge pages."""
from __future__ import annotations

import logging

import torch
from torch import nn

from pagedserve.kernels.cpu.moe import bf16_available, exact_in_bf16, pack_experts, pack_experts_bf16, pack_experts_int8
from pagedserve.worker.cpu.hugepages import empty_huge_pages
from pagedserve.worker.cpu.packing import panel_gemm_preferred
from pagedserve.worker.layers.moe import SparseMoeBlock

logger = logging.getLogger(__name__)


def pack_moe_experts(model: nn.Module, panels: bool | None = None, bf16_panels: bool | None = None) -> int:
    """Pack each MoE block's experts; returns how many blocks. ``panels``, ``bf16_panels``: as ``pack_linears``'
    (default: where the fp32 panel GEMM is preferred; where the bf16 kernel is built)."""
    fp32 = panel_gemm_preferred() if panels is None else panels
    bf16 = bf16_available() if bf16_panels is None else bf16_panels
    kinds: list[str] = []
    for block in model.modules():
        if not isinstance(block, SparseMoeBlock) or len(block.experts) == 0:
            continue
        loaded = block.loaded_experts()
        gate_up, down, start = loaded.gate_up, loaded.down, loaded.expert_start
        if any(w.device.type != "cpu" for w in gate_up + down):
            continue
        dtypes = {w.dtype for w in gate_up + down}
        if dtypes == {torch.bfloat16} and bf16:
            block.moe_panels = pack_experts_bf16(gate_up, down, start, empty_huge_pages)
            kinds.append("bf16 activations")
        elif dtypes == {torch.int8} and bf16 and block.gate.weight.dtype == torch.bfloat16:  # the router: unquantized
            block.moe_panels = pack_experts_int8(gate_up, loaded.gate_up_scale, down, loaded.down_scale, start,
                                                 empty_huge_pages)
            kinds.append("bf16 activations, int8 experts")
        elif dtypes == {torch.float32} and fp32:
            dtype = torch.bfloat16 if exact_in_bf16(gate_up + down) else torch.float32
            block.moe_panels = pack_experts(gate_up, down, start, dtype, empty_huge_pages)
            kinds.append(f"fp32 activations, {str(dtype).removeprefix('torch.')} panels")
        else:
            continue
        block.experts = nn.ModuleDict()
    if kinds:
        logger.info("fused MoE: packed the experts of %d layers (%s)", len(kinds), ", ".join(sorted(set(kinds))))
    return len(kinds)
