"""The kernel choices a worker makes once, from its device and the engine's flags: the backend
(``--attention-backend``) and the KV cache's storage dtype (``--kv-cache-dtype``)."""
from __future__ import annotations

import torch

from pagedserve.kernels.backend import KernelBackend
from pagedserve.kernels.cpu.backend import CpuBackend

try:  # CUDA builds of torch bring triton; the CPU build, which the C++ and torch backends need alone, does not.
    from pagedserve.kernels.triton.backend import TritonBackend
except ModuleNotFoundError as e:
    if e.name != "triton":
        raise
    TritonBackend = None

BACKENDS = {
    "torch": "the spec (kernels/torch_ref.py) for every op, on any device",
    "cpu": "the C++ kernels (kernels/cpu/), the spec where they do not apply",
    "triton": "Triton attention and KV-cache kernels (kernels/triton/), the spec for the rest",
}

# vLLM's kv_cache_dtype names; "auto" stores the model's dtype.
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype for ``--kv-cache-dtype name``."""
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def default_backend(device_type: str) -> str:
    return "triton" if device_type == "cuda" else "cpu"


def select_backend(name: str, device: torch.device, dtype: torch.dtype) -> KernelBackend:
    """The backend ``name`` for a worker on ``device`` whose model runs ``dtype``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose one of {sorted(BACKENDS)}")
    if name == "cpu":
        return CpuBackend(device, dtype)  # a failed build raises here, naming attention_backend="torch"
    if name == "triton":
        if TritonBackend is None:
            raise ImportError('attention_backend="triton" needs triton: pip install triton (CUDA torch brings it)')
        return TritonBackend(device)
    return KernelBackend(device)
