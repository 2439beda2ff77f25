"""Attention and KV-cache ops behind one interface, with selectable backends.

A backend is a module exposing ``reshape_and_cache``, ``paged_attention``, ``copy_blocks`` and
``swap_blocks`` with the signatures of :mod:`pagedserve.kernels.torch_ref`.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from pagedserve.kernels import cpu_extension

BACKENDS = {
    "torch": "pagedserve.kernels.torch_ref",
    "triton": "pagedserve.kernels.triton_ops",
    "cpu": "pagedserve.kernels.cpu_ops",  # C++ attention and KV writes (fp32, bf16), torch ops for the rest
}


# vLLM's kv_cache_dtype names; "auto" stores the model's dtype.
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype for ``--kv-cache-dtype name``."""
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def default_backend(device_type: str) -> str:
    return "triton" if device_type == "cuda" else "cpu"


def get_backend(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose one of {sorted(BACKENDS)}")
    if name == "cpu":
        cpu_extension.load()  # a failed build raises here, naming attention_backend="torch"
    return importlib.import_module(BACKENDS[name])
