"""Fused element-wise CPU kernels in C++: RMSNorm (with the residual add), SiLU-and-mul, rotary, KV-cache writes,
structured output's token bitmask on the logits, and greedy sampling's argmax.

The kernels: ``csrc/fused.cpp``.
"""
from __future__ import annotations

import torch

from pagedserve.kernels import cpu_extension


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels take these tensors: CPU, fp32 or bf16, last dim a multiple of 8, built."""
    return all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16) and t.shape[-1] % 8 == 0
               and t.stride(-1) == 1 for t in tensors) and cpu_extension.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype)
    cpu_extension.load().rms_norm(x, weight, eps, out)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual += x``, then ``x = rms_norm(residual) * weight``."""
    cpu_extension.load().fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype)
    cpu_extension.load().silu_and_mul(x, out)
    return out


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           rotary_dim: int) -> None:
    """In place on q [T, Hq, D] and k [T, Hkv, D] (rows and heads may be strided)."""
    cpu_extension.load().rotary(positions, q, k, cos, sin, rotary_dim)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    cpu_extension.load().reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``torch_ref.apply_token_bitmask`` on fp32 CPU logits: a copy, masked in place from the packed words."""
    out = logits.clone()
    cpu_extension.load().apply_token_bitmask(out, rows, bitmask)
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=1)`` for fp32 CPU rows ``[B, V]``."""
    out = torch.empty(x.shape[0], dtype=torch.long)
    cpu_extension.load().argmax_rows(x, out)
    return out
