"""Fused element-wise CPU kernels in C++: RMSNorm (with the residual add), SiLU-and-mul, rotary, KV-cache writes,
structured output's token bitmask on the logits, greedy sampling's argmax and random sampling.

Each kernel has a predicate, ``<kernel>_supported``, that holds exactly where the C++ takes its arguments (its
``TORCH_CHECK`` preconditions); callers take their torch path where it does not. No size needs to be a multiple of
the vector width: the kernels finish each row with a scalar tail.

The kernels: ``csrc/fused.cpp``, and ``csrc/sampling.cpp`` for random sampling.
"""
from __future__ import annotations

import torch

from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.kernels.torch_ref import FP8_DTYPES

_DTYPES = (torch.float32, torch.bfloat16)


def _cpu(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = _DTYPES) -> bool:
    return all(t.device.type == "cpu" and t.dtype in dtypes for t in tensors)


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether :func:`rms_norm` (or, with ``residual``, :func:`fused_add_rms_norm`) takes these tensors: CPU fp32
    or bf16 of one dtype; ``x`` (and ``residual``, same shape) rows ``[T, H]`` with unit stride along H; a
    contiguous ``weight [H]``; the extension built. Any H."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    return (_cpu(*tensors) and len({t.dtype for t in tensors}) == 1 and x.dim() == 2 and x.stride(-1) == 1
            and weight.dim() == 1 and weight.shape[0] == x.shape[1] and weight.is_contiguous()
            and (residual is None or (residual.shape == x.shape and residual.stride(-1) == 1))
            and cpu_extension.available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Where :func:`rms_norm_supported`."""
    out = torch.empty(x.shape, dtype=x.dtype)
    cpu_extension.load().rms_norm(x, weight, eps, out)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual += x``, then ``x = rms_norm(residual) * weight``. Where :func:`rms_norm_supported`."""
    cpu_extension.load().fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul_supported(x: torch.Tensor) -> bool:
    """Whether :func:`silu_and_mul` takes ``x``: CPU fp32 or bf16 rows ``[T, 2I]`` with unit stride along them;
    the extension built. Any I (a tensor-parallel rank's share of the intermediate size)."""
    return (_cpu(x) and x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(-1) == 1
            and cpu_extension.available())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]``, where :func:`silu_and_mul_supported`."""
    out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype)
    cpu_extension.load().silu_and_mul(x, out)
    return out


def rotary_supported(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, rotary_dim: int) -> bool:
    """Whether :func:`rotary` takes these tensors: CPU ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` of one dtype (fp32
    or bf16) with unit stride along D (rows and heads may be strided); int64 contiguous ``positions [T]``; fp32
    contiguous ``cos`` and ``sin`` ``[max_pos, rotary_dim / 2]``; an even ``rotary_dim <= D``; the extension
    built. Any D and head counts."""
    return (_cpu(q, k) and q.dtype == k.dtype and q.dim() == 3 and k.dim() == 3 and q.stride(2) == 1
            and k.stride(2) == 1 and rotary_dim % 2 == 0 and 0 <= rotary_dim <= min(q.shape[2], k.shape[2])
            and q.shape[0] == k.shape[0] == positions.numel() and positions.dtype == torch.int64
            and positions.is_contiguous() and positions.device.type == "cpu"
            and _cpu(cos, sin, dtypes=(torch.float32,)) and cos.is_contiguous() and sin.is_contiguous()
            and cos.dim() == 2 and cos.shape == sin.shape and cos.shape[1] == rotary_dim // 2
            and cpu_extension.available())


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           rotary_dim: int) -> None:
    """In place on q [T, Hq, D] and k [T, Hkv, D], where :func:`rotary_supported`."""
    cpu_extension.load().rotary(positions, q, k, cos, sin, rotary_dim)


def reshape_and_cache_supported(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor) -> bool:
    """Whether :func:`reshape_and_cache` takes these tensors: CPU fp32 or bf16 ``key`` and ``value [T, Hkv, D]`` of
    the caches' dtype or for fp8 caches, each token's heads contiguous (tokens may be strided); contiguous caches
    ``[N, bs, Hkv, D]`` of one shape; the extension built. Any head count and size (rows are copied whole)."""
    return (_cpu(key, value) and _cpu(k_cache, v_cache, dtypes=(*_DTYPES, *FP8_DTYPES))
            and key.dtype == value.dtype and k_cache.dtype == v_cache.dtype
            and (key.dtype == k_cache.dtype or k_cache.dtype in FP8_DTYPES)
            and key.dim() == 3 and key.shape == value.shape and k_cache.dim() == 4
            and k_cache.shape == v_cache.shape and tuple(k_cache.shape[2:]) == tuple(key.shape[1:])
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value))
            and k_cache.is_contiguous() and v_cache.is_contiguous() and cpu_extension.available())


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Where :func:`reshape_and_cache_supported`; ``slot_mapping`` int64, one slot per token (-1: skip); an fp8
    cache stores rows divided by their scale (``torch_ref.reshape_and_cache``)."""
    cpu_extension.load().reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def apply_token_bitmask_supported(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """Whether :func:`apply_token_bitmask` takes these tensors: CPU fp32 ``logits [B, V]`` with unit stride along
    V; int64 ``rows [R]``; int32 ``bitmask [R, W]`` (any W: tokens past its 32 W bits are masked); the extension
    built. Any V."""
    return (_cpu(logits, dtypes=(torch.float32,)) and logits.dim() == 2 and logits.stride(1) == 1
            and rows.device.type == "cpu" and rows.dtype == torch.int64 and rows.dim() == 1
            and bitmask.device.type == "cpu" and bitmask.dtype == torch.int32 and bitmask.dim() == 2
            and rows.shape[0] == bitmask.shape[0] and cpu_extension.available())


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``torch_ref.apply_token_bitmask`` on fp32 CPU logits: a copy, masked in place from the packed words. Where
    :func:`apply_token_bitmask_supported`."""
    out = logits.clone()
    cpu_extension.load().apply_token_bitmask(out, rows, bitmask)
    return out


def gather_rows_supported(src: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether :func:`gather_rows` takes these: a contiguous CPU ``src [V, H]``, CPU int64 ids of any shape; the
    extension built."""
    return (ids.device.type == "cpu" and src.device.type == "cpu" and ids.dtype == torch.long
            and src.dim() == 2 and src.is_contiguous() and cpu_extension.available())


def gather_rows(src: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``src[ids]`` (``F.embedding(ids, src)``) on the kernels' threads, where :func:`gather_rows_supported`;
    IndexError for an id out of range."""
    out = torch.empty(ids.numel(), src.shape[1], dtype=src.dtype)
    cpu_extension.load().gather_rows(ids.reshape(-1), src, out)
    return out.view(*ids.shape, src.shape[1])


def sample_supported(logits: torch.Tensor) -> bool:
    """Whether :func:`sample` takes ``logits``: CPU fp32 rows ``[B, V]`` with unit stride along V, 0 < V < 2^31; the
    extension built."""
    return argmax_supported(logits)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
           min_p: torch.Tensor | None, uniform: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """One token per row: drawn with ``uniform`` (fp64 in (0, 1)) from softmax(logits / temperature) after min-p,
    top-k and top-p (each None where no row uses it), or ``greedy``'s where the temperature is 0. Where
    :func:`sample_supported`; ``torch_ref.sample_rows`` is its definition."""
    none = torch.empty(0)
    out = torch.empty(logits.shape[0], dtype=torch.long)
    cpu_extension.load().sample_rows(
        logits, temperature.float().contiguous(), none if top_k is None else top_k.long().contiguous(),
        none if top_p is None else top_p.float().contiguous(), none if min_p is None else min_p.float().contiguous(),
        uniform.double().contiguous(), greedy.long().contiguous(), out)
    return out


def argmax_supported(x: torch.Tensor) -> bool:
    """Whether :func:`argmax` takes ``x``: CPU fp32 rows ``[B, V]`` with unit stride along V, 0 < V < 2^31; the
    extension built. Any V in that range."""
    return (_cpu(x, dtypes=(torch.float32,)) and x.dim() == 2 and x.stride(1) == 1 and 0 < x.shape[1] < 2 ** 31
            and cpu_extension.available())


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=1)`` for fp32 CPU rows ``[B, V]``, where :func:`argmax_supported`."""
    out = torch.empty(x.shape[0], dtype=torch.long)
    cpu_extension.load().argmax_rows(x, out)
    return out
