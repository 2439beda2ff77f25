"""Attention and KV-cache ops behind one interface, with selectable backends.

A backend is a module exposing ``reshape_and_cache``, ``paged_attention``, ``copy_blocks`` and
``swap_blocks`` with the signatures of :mod:`pagedserve.kernels.torch_ref`.
"""
from __future__ import annotations

import importlib
from types import ModuleType

BACKENDS = {
    "torch": "pagedserve.kernels.torch_ref",
    "triton": "pagedserve.kernels.triton_ops",
}


def default_backend(device_type: str) -> str:
    return "triton" if device_type == "cuda" else "torch"


def get_backend(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose one of {sorted(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])
