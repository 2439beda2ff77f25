"""``dtype="auto"`` on CPU: the checkpoint's half dtype where this CPU runs its matmuls natively, else fp32."""
from __future__ import annotations

import functools
import logging
import time

import torch

from pagedserve.worker.cpu.cpuinfo import cpu_flags

logger = logging.getLogger(__name__)

# CPU flags with which oneDNN runs the dtype's matmuls natively (AMX tiles, or AVX-512 dot-product instructions).
FAST_CPU_FLAGS = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")}


def matmul_speedup(dtype: torch.dtype, n: int = 384, rounds: int = 5) -> float:
    """How many times faster an n x n matmul runs in ``dtype`` than in fp32 here, best of ``rounds``. Each round
    times both dtypes back to back, so that a moment when other processes hold the cores slows both alike."""
    pairs = {dt: (torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)) for dt in (torch.float32, dtype)}
    for a, b in pairs.values():  # first calls pay for library set-up
        a @ b
    best = dict.fromkeys(pairs, float("inf"))
    for _ in range(rounds):
        for dt, (a, b) in pairs.items():
            t = time.perf_counter()
            a @ b
            best[dt] = min(best[dt], time.perf_counter() - t)
    return best[torch.float32] / best[dtype]


def choose_cpu_dtype(checkpoint: torch.dtype, flags: set[str], speedup=matmul_speedup) -> tuple[torch.dtype, str]:
    """The checkpoint's half dtype where this CPU has the instructions for it and a matmul probe confirms they
    beat fp32; fp32 otherwise. ``speedup(dtype)`` is only called when the flags are there."""
    if checkpoint not in FAST_CPU_FLAGS:
        return torch.float32, f"the checkpoint is {checkpoint}"
    have = sorted(f for f in FAST_CPU_FLAGS[checkpoint] if f in flags)
    if not have:
        return torch.float32, (f"this CPU has none of {'/'.join(FAST_CPU_FLAGS[checkpoint])} for {checkpoint} "
                               "matmuls (they would be emulated, many times slower than fp32)")
    ratio = speedup(checkpoint)
    if ratio < 1.0:
        return torch.float32, f"the CPU has {'/'.join(have)} but a {checkpoint} matmul measured {ratio:.2f}x fp32"
    return checkpoint, f"the CPU has {'/'.join(have)}; a {checkpoint} matmul measured {ratio:.2f}x fp32"


@functools.cache
def auto_dtype(checkpoint: torch.dtype) -> torch.dtype:
    """``dtype="auto"`` on CPU, decided (and logged) once per process and checkpoint dtype."""
    dtype, why = choose_cpu_dtype(checkpoint, cpu_flags())
    logger.info("dtype auto on CPU: %s (%s); --dtype overrides", str(dtype).removeprefix("torch."), why)
    return dtype
