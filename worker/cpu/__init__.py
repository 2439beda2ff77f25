"""The CPU seam: what makes a model fast on CPU, kept out of the model files.

- :func:`auto_dtype`: the engine's ``dtype="auto"`` on CPU (``dtype.py``).
- :func:`prepare_model`: after loading, packs the MoE experts for the fused MoE kernel (``moe_packing.py``) and every
  other linear weight into the layout the kernel backend's linear reads (``packing.py``) and, for LLaMA-style models
  under the C++ backend, sets up one call per decoder layer (``decoder_layer.py``).

The KV cache and the panels live on huge pages (``hugepages.py``).
"""
from __future__ import annotations

from torch import nn

from pagedserve.kernels.backend import KernelBackend
from pagedserve.worker.cpu.decoder_layer import attach_decoder_layers
from pagedserve.worker.cpu.dtype import auto_dtype
from pagedserve.worker.cpu.hugepages import zeros_huge_pages
from pagedserve.worker.cpu.moe_packing import pack_moe_experts
from pagedserve.worker.cpu.packing import pack_linears

__all__ = ["auto_dtype", "prepare_model", "zeros_huge_pages"]


def prepare_model(model: nn.Module, backend: KernelBackend) -> None:
    """Ready a loaded model for the backend that will run it."""
    plan = backend.packing()
    if plan is not None:
        pack_moe_experts(model, panels=plan.panels, bf16_panels=plan.bf16_panels)
        pack_linears(model, panels=plan.panels, bf16_panels=plan.bf16_panels, int8_panels=plan.int8_panels)
    if backend.fused_decoder_layer:
        attach_decoder_layers(model)
