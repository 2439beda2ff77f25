"""The CPU seam: what makes a model fast on CPU, kept out of the model files.

- :func:`auto_dtype`: the engine's ``dtype="auto"`` on CPU (``dtype.py``).
- :func:`prepare_model`: after loading, packs every linear weight into the layout its GEMM reads (``packing.py``)
  and, for LLaMA-style models, sets up one C++ call per decoder layer (``decoder_layer.py``).
- :func:`linear`: what the linear and LM-head layers call, through the packed weight (``packed_linear.py``);
  ``REUSED_OUT_ROWS``: the most rows whose output it writes into a buffer the layer keeps.

The C++ paths (panel GEMMs, one-call layers) run only under the C++ attention backend (``--attention-backend cpu``,
the CPU default); under ``torch`` a CPU model runs torch and oneDNN alone. The KV cache and the panels live on huge
pages (``hugepages.py``).
"""
from __future__ import annotations

from types import ModuleType

from torch import nn

from pagedserve.kernels import cpu_ops
from pagedserve.worker.cpu.decoder_layer import attach_decoder_layers
from pagedserve.worker.cpu.dtype import auto_dtype
from pagedserve.worker.cpu.hugepages import zeros_huge_pages
from pagedserve.worker.cpu.packed_linear import REUSED_OUT_ROWS, linear
from pagedserve.worker.cpu.packing import pack_linears

__all__ = ["REUSED_OUT_ROWS", "auto_dtype", "linear", "prepare_model", "zeros_huge_pages"]


def prepare_model(model: nn.Module, backend: ModuleType) -> None:
    """Ready a loaded CPU model for serving; ``backend`` is the attention backend the model runner resolved."""
    if backend is cpu_ops:
        pack_linears(model)
        attach_decoder_layers(model)
    else:
        pack_linears(model, panels=False, bf16_panels=False, int8_panels=False)
