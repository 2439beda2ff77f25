"""The fused MoE layer on CPU: this rank's experts packed once into panels, gate and up side by side, and one C++ call
per layer; ``torch_ref.fused_moe`` is its spec.

fp32 activations (``csrc/moe.cpp``): panels of the fp32 GEMM's layout; experts whose values are all bf16 numbers (a
bf16 checkpoint run in fp32) are packed in bf16: the same sums from half the bytes, which is what a decode step's
MoE layer is bound by. bf16 activations (``csrc/moe_bf16.cpp``, CPUs with AVX512-BF16): the bf16 GEMM's k-pair
panels, run on AMX tiles where the CPU has them."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.kernels import torch_ref
from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.kernels.cpu import gemm_bf16, gemm_int8
from pagedserve.kernels.cpu.gemm import PANEL

HALF = PANEL // 2  # gate (and up) rows per gate-up panel
HALF_BF16 = gemm_bf16.PANEL // 2  # the same in a bf16 panel
PANEL_K = 32  # the bf16 kernel's AMX k step: H and I are padded to whole ones
_NO_SCALE = torch.empty(0)


@dataclass(frozen=True)
class MoePanels:
    w13: torch.Tensor  # [E, ceil(I / 8), H, 16]: gate rows 8q .. 8q+7 in columns 0-7, the same up rows in 8-15
    w2: torch.Tensor  # [E, ceil(H / 16), I, 16]; both fp32 or both bf16
    intermediate_size: int  # I
    expert_start: int  # the global id of expert 0 here


@dataclass(frozen=True)
class MoeBF16Panels:
    """Experts for bf16 activations. bf16 experts: k-pair panels. int8 ones: panels of the int8 GEMM's layout
    ``[K, 32]`` and their per-column scales, in the same column order."""

    w13: torch.Tensor  # [E, Ip / 16, Hp / 2, 32, 2] bf16 or [E, Ip / 16, Hp, 32] int8: 16 gate rows, the same 16 up
    w2: torch.Tensor  # [E, ceil(H / 32), Ip / 2, 32, 2] or [E, ceil(H / 32), Ip, 32]; Hp, Ip: H and I rounded to 32
    expert_start: int
    w13_scale: torch.Tensor | None = None  # int8: [E, Ip / 16, 32] fp32
    w2_scale: torch.Tensor | None = None  # int8: [E, ceil(H / 32), 32] fp32


Empty = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def exact_in_bf16(weights: list[torch.Tensor]) -> bool:
    """Whether every value is a bf16 number (as in a bf16 checkpoint), so bf16 panels hold them exactly."""
    return all(torch.equal(w.to(torch.bfloat16).to(w.dtype), w) for w in weights)


def pack_experts(gate_up: list[torch.Tensor], down: list[torch.Tensor], expert_start: int,
                 dtype: torch.dtype = torch.float32, empty: Empty = _empty) -> MoePanels:
    """``gate_up [2I, H]`` and ``down [H, I]`` of experts ``expert_start, expert_start + 1, ...`` in ``dtype`` panels
    (float32, or bfloat16 where :func:`exact_in_bf16`), in tensors from ``empty(shape, dtype)``."""
    hidden, inter = down[0].shape
    p13, p2 = -(-inter // HALF), -(-hidden // PANEL)
    w13 = empty((len(gate_up), p13, hidden, PANEL), dtype)
    w2 = empty((len(down), p2, inter, PANEL), dtype)
    for e, (gu, d) in enumerate(zip(gate_up, down)):
        halves = torch.zeros(2, p13 * HALF, hidden, dtype=torch.float32)
        halves[0, :inter], halves[1, :inter] = gu[:inter], gu[inter:]
        w13[e] = halves.view(2, p13, HALF, hidden).permute(1, 3, 0, 2).reshape(p13, hidden, PANEL)
        rows = torch.zeros(p2 * PANEL, inter, dtype=torch.float32)
        rows[:hidden] = d
        w2[e] = rows.view(p2, PANEL, inter).transpose(1, 2)
    return MoePanels(w13, w2, inter, expert_start)


def routing_supported(router_logits: torch.Tensor, top_k: int) -> bool:
    return (router_logits.dim() == 2 and router_logits.dtype in (torch.float32, torch.bfloat16)
            and router_logits.stride(-1) == 1 and 1 <= top_k <= router_logits.shape[-1])


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> torch_ref.ExpertRouting:
    """``torch_ref.select_experts`` in one C++ call (no torch op, so no OpenMP region between the layer's kernels)."""
    weights = torch.empty(router_logits.shape[0], top_k, dtype=torch.float32)
    experts = torch.empty(router_logits.shape[0], top_k, dtype=torch.int64)
    cpu_extension.load().select_experts(router_logits, top_k, renormalize, weights, experts)
    return torch_ref.ExpertRouting(weights, experts)


def supported(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.dim() == 2


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, panels: MoePanels) -> torch.Tensor:
    """This rank's share of the layer for fp32 ``x [T, H]`` (see ``torch_ref.fused_moe``)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    cpu_extension.load().moe_fp32(x.contiguous(), topk_ids.contiguous(), topk_weights.float().contiguous(),
                                  panels.expert_start, panels.w13, panels.w2, panels.intermediate_size, out)
    return out


def bf16_available() -> bool:
    """Whether the extension has the bf16 kernel (built for a CPU with AVX512-BF16)."""
    return cpu_extension.available() and cpu_extension.load().moe_bf16_built()


def _padded(w: torch.Tensor, rows: int, cols: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    out = torch.zeros(rows, cols, dtype=dtype)
    out[:w.shape[0], :w.shape[1]] = w
    return out


def pack_experts_bf16(gate_up: list[torch.Tensor], down: list[torch.Tensor], expert_start: int,
                      empty: Empty = _empty) -> MoeBF16Panels:
    """bf16 ``gate_up [2I, H]`` and ``down [H, I]`` of experts ``expert_start, ...`` in the bf16 kernel's panels:
    any H and I (zero-padded to whole AMX k steps), in tensors from ``empty(shape, dtype)`` (the worker's: on huge
    pages)."""
    hidden, inter = down[0].shape
    hp, ip = -(-hidden // PANEL_K) * PANEL_K, -(-inter // PANEL_K) * PANEL_K
    p2 = -(-hidden // gemm_bf16.PANEL)
    w13 = empty((len(gate_up), ip // HALF_BF16, hp // 2, gemm_bf16.PANEL, 2), torch.bfloat16)
    w2 = empty((len(down), p2, ip // 2, gemm_bf16.PANEL, 2), torch.bfloat16)
    for e, (gu, d) in enumerate(zip(gate_up, down)):
        halves = torch.stack([_padded(gu[:inter], ip, hp), _padded(gu[inter:], ip, hp)])  # [2, Ip, Hp]
        interleaved = halves.view(2, ip // HALF_BF16, HALF_BF16, hp).transpose(0, 1).reshape(2 * ip, hp)
        gemm_bf16.pack_weight(interleaved, w13[e].view(ip // HALF_BF16, hp // 2, gemm_bf16.PANEL, 2))
        gemm_bf16.pack_weight(_padded(d, hidden, ip), w2[e])
    return MoeBF16Panels(w13, w2, expert_start)


def pack_experts_int8(gate_up: list[torch.Tensor], gate_up_scale: list[torch.Tensor], down: list[torch.Tensor],
                      down_scale: list[torch.Tensor], expert_start: int, empty: Empty = _empty) -> MoeBF16Panels:
    """Weight-only int8 experts (``torch_ref.quantize_int8``: int8 ``gate_up [2I, H]``, ``down [H, I]`` and their
    per-row fp32 scales) in the int8 GEMM's panels with their scales, for the bf16 kernel: any H and I."""
    hidden, inter = down[0].shape
    hp, ip = -(-hidden // PANEL_K) * PANEL_K, -(-inter // PANEL_K) * PANEL_K
    p13, p2 = ip // HALF_BF16, -(-hidden // gemm_int8.PANEL)
    w13 = empty((len(gate_up), p13, hp, gemm_int8.PANEL), torch.int8)
    w2 = empty((len(down), p2, ip, gemm_int8.PANEL), torch.int8)
    s13 = torch.ones(len(gate_up), p13, gemm_int8.PANEL)
    s2 = torch.ones(len(down), p2 * gemm_int8.PANEL)
    for e, (gu, gs, d, ds) in enumerate(zip(gate_up, gate_up_scale, down, down_scale)):
        halves = torch.stack([_padded(gu[:inter], ip, hp, torch.int8), _padded(gu[inter:], ip, hp, torch.int8)])
        scales = torch.ones(2, ip)
        scales[0, :inter], scales[1, :inter] = gs[:inter], gs[inter:]
        gemm_int8.pack_weight(halves.view(2, p13, HALF_BF16, hp).transpose(0, 1).reshape(2 * ip, hp),
                              torch.empty(0), w13[e])
        s13[e] = scales.view(2, p13, HALF_BF16).transpose(0, 1).reshape(p13, gemm_int8.PANEL)
        gemm_int8.pack_weight(_padded(d, hidden, ip, torch.int8), torch.empty(0), w2[e])
        s2[e, :hidden] = ds
    return MoeBF16Panels(w13, w2, expert_start, s13, s2.view(len(down), p2, gemm_int8.PANEL))


def bf16_supported(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.dim() == 2


def fused_moe_bf16(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, panels: MoeBF16Panels,
                   use_amx: bool = True) -> torch.Tensor:
    """This rank's share of the layer for bf16 ``x [T, H]``; ``use_amx=False`` takes the AVX512-BF16 kernel on an AMX
    CPU too (tests, benchmarks)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    cpu_extension.load().moe_bf16(x.contiguous(), topk_ids.contiguous(), topk_weights.float().contiguous(),
                                  panels.expert_start, panels.w13, panels.w2, out, use_amx,
                                  _NO_SCALE if panels.w13_scale is None else panels.w13_scale,
                                  _NO_SCALE if panels.w2_scale is None else panels.w2_scale)
    return out
