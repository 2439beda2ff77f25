"""Builds the C++ CPU kernels (attention, fused norms/activations/rotary) into one extension on first use.

Compiled with ``-march=native`` where it runs, with torch's extension loader (cached under
``TORCH_EXTENSIONS_DIR``); ``load()`` returns None where no compiler is available and callers use torch ops.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

_module = None
_failed = False


def _sources() -> tuple[str, dict[str, str]]:
    from pagedserve.kernels import (
        cpu_attention,
        cpu_attention_bf16,
        cpu_common,
        cpu_fused,
        cpu_gemm,
        cpu_gemm_bf16,
        cpu_layer,
    )

    parts = [cpu_attention, cpu_attention_bf16, cpu_fused, cpu_gemm, cpu_gemm_bf16, cpu_layer]
    functions = {name: impl for part in parts for name, impl in part.FUNCTIONS.items()}
    binding = "\n".join(f'  m.def("{name}", &{impl});' for name, impl in functions.items())
    source = "\n".join([cpu_common.HEADER, *(part.SOURCE for part in parts),
                        f"PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{binding}\n}}\n"])
    return source, functions


def load():
    """The compiled extension, or None where it cannot be built (callers fall back to torch)."""
    global _module, _failed
    if _module is None and not _failed:
        try:
            from torch.utils.cpp_extension import load_inline

            source, _ = _sources()
            # -ffp-contract=fast: a * b + c as one FMA (ISO C++ mode turns contraction off).
            _module = load_inline(
                name="pagedserve_cpu_kernels", cpp_sources=[source],
                extra_cflags=["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"], extra_ldflags=["-fopenmp"],
                verbose=bool(os.environ.get("PAGEDSERVE_VERBOSE_BUILD")))
        except Exception as e:  # a missing compiler or ninja: the torch path still works
            _failed = True
            logger.warning("CPU kernels unavailable (%s); using torch ops", e)
    return _module
