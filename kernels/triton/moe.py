"""The MoE experts in two grouped-GEMM launches (``torch_ref.fused_moe``'s semantics).

The (token, choice) pairs routed to this rank's experts are sorted by expert and each expert's run padded to
``BLOCK_M`` rows (:func:`align_by_expert`, torch ops, no host sync), so every row block of the launch belongs to one
expert. Launch 1 reads each block's expert's gate and up rows once per block and writes ``silu(gate) * up`` in
sorted order; launch 2 multiplies that by the expert's down rows, applies the routing weight and writes each pair's
row in fp32; the k choices of a token are summed at the end. int8 experts (``--quantization int8``) are widened in
registers and scaled per output channel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels import torch_ref
from pagedserve.kernels.triton.attention import _interpreting, _mma

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class StackedExperts:
    """One rank's experts as two stacked tensors: ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``
    for experts ``expert_start .. expert_start + E - 1``; int8 ones with fp32 per-row scales ``[E, 2I]``, ``[E, H]``."""

    w13: torch.Tensor
    w2: torch.Tensor
    expert_start: int
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]


@dataclass(frozen=True)
class ExpertBlocks:
    """The pairs in expert order: ``sorted_pairs[r]`` is the flat (token * top_k + choice) index of row r, or
    ``num_pairs`` for a padding row; ``block_expert[b]`` the local expert of rows ``b*BLOCK_M ..``, -1 if unused."""

    sorted_pairs: torch.Tensor  # [num_blocks * block_m] int32
    block_expert: torch.Tensor  # [num_blocks] int32
    block_m: int


def stack_experts(gate_up: list[torch.Tensor], down: list[torch.Tensor], expert_start: int,
                  gate_up_scale: list[torch.Tensor] | None = None,
                  down_scale: list[torch.Tensor] | None = None) -> StackedExperts:
    def stack(ts: list[torch.Tensor] | None) -> torch.Tensor | None:
        return None if ts is None else torch.stack(ts).contiguous()

    return StackedExperts(stack(gate_up), stack(down), expert_start, stack(gate_up_scale), stack(down_scale))


def supported(x: torch.Tensor, experts: StackedExperts) -> bool:
    """Whether the kernels take these activations: 2-D, a float dtype, the experts' own dtype (or int8 experts)."""
    w_dtype = experts.w13.dtype
    return (x.dim() == 2 and x.dtype in _FLOAT_DTYPES and x.device == experts.w13.device
            and (w_dtype == x.dtype or (w_dtype == torch.int8 and experts.w13_scale is not None)))


def reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              experts: StackedExperts) -> torch.Tensor:
    """The spec on the stacked tensors (the fallback)."""
    def unbind(t: torch.Tensor | None) -> list[torch.Tensor] | None:
        return None if t is None else list(t.unbind(0))

    return torch_ref.fused_moe(x, unbind(experts.w13), unbind(experts.w2), topk_ids, topk_weights,
                               experts.expert_start, unbind(experts.w13_scale), unbind(experts.w2_scale))


def align_by_expert(topk_ids: torch.Tensor, expert_start: int, num_experts: int, block_m: int) -> ExpertBlocks:
    """Group the pairs by local expert, each group padded to ``block_m`` rows; pairs of other ranks' experts are
    left out. Sized for the worst case (every group partly filled), so nothing is read back to the host."""
    local = topk_ids.flatten().long() - expert_start
    num_pairs = local.numel()
    key = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    order = key.argsort(stable=True)
    sorted_key = key[order]
    counts = torch.bincount(key, minlength=num_experts + 1)
    starts = counts.cumsum(0) - counts
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    capacity = num_blocks * block_m
    ours = sorted_key < num_experts
    expert = sorted_key.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=local.device) - starts[sorted_key]
    dest = torch.where(ours, padded_ends[expert] - padded[expert] + rank, capacity)  # the last slot: a dump
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=local.device)
    sorted_pairs[dest] = order.to(torch.int32)
    block = torch.searchsorted(padded_ends // block_m, torch.arange(num_blocks, device=local.device), right=True)
    block_expert = torch.where(block < num_experts, block, -1).to(torch.int32)
    return ExpertBlocks(sorted_pairs[:capacity], block_expert, block_m)


@triton.jit
def _widen(w, dtype: tl.constexpr, W_INT8: tl.constexpr):
    # int8 values are exact in every float dtype; through fp32, as the interpreter casts int8 to bf16 wrongly.
    if W_INT8:
        return w.to(tl.float32).to(dtype)
    else:
        return w


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # launch 1: x [T, H]; launch 2: the SiLU·up rows [capacity, I], in sorted order
    w_ptr,  # [E, N (x2 in launch 1), K]
    scale_ptr,  # [E, N (x2)] fp32, read when W_INT8
    out_ptr,  # launch 1: [capacity, I]; launch 2: [num_pairs, H] fp32
    sorted_pairs_ptr,
    block_expert_ptr,
    topk_weights_ptr,  # [num_pairs] fp32, read in launch 2
    num_pairs,
    N,
    K,
    top_k,
    stride_a,
    stride_we,
    stride_wn,
    stride_se,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATE_UP: tl.constexpr,
    W_INT8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_pairs_ptr + rows)
        valid = pairs < num_pairs
        a_rows = pairs // top_k if GATE_UP else rows
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(a_ptr + a_rows.to(tl.int64)[:, None] * stride_a + ks[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_mask = col_ok[None, :] & k_ok[:, None]
            w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0)
            acc += _mma(a, _widen(w, a.dtype, W_INT8), DOT_PRECISION, UPCAST_DOT)
            if GATE_UP:
                w_up = tl.load(w_base + (cols + N)[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0)
                acc_up += _mma(a, _widen(w_up, a.dtype, W_INT8), DOT_PRECISION, UPCAST_DOT)
        out_ty = out_ptr.dtype.element_ty
        if W_INT8:
            s_base = scale_ptr + expert.to(tl.int64) * stride_se
            acc = acc * tl.load(s_base + cols, mask=col_ok, other=0.0)[None, :]
            if GATE_UP:
                acc_up = acc_up * tl.load(s_base + N + cols, mask=col_ok, other=0.0)[None, :]
        out_mask = valid[:, None] & col_ok[None, :]
        if GATE_UP:
            # Rounded where the spec rounds: each projection, the SiLU and the product, in the activations' dtype.
            a_ty = a_ptr.dtype.element_ty
            gate = acc.to(a_ty).to(tl.float32)
            up = acc_up.to(a_ty).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(a_ty).to(tl.float32)
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], (silu * up).to(out_ty),
                     mask=out_mask)
        else:
            weight = tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0)
            y = acc.to(a_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
            tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_out + cols[None, :], y, mask=out_mask)


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: 16 (``tl.dot``'s least) while experts get a few pairs each, more once they get many."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def _launch(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, out: torch.Tensor, blocks: ExpertBlocks,
            topk_weights: torch.Tensor, top_k: int, n: int, gate_up: bool) -> None:
    on_gpu = a.device.type == "cuda" and not _interpreting()
    block_n = 64 if on_gpu else 32
    block_k = (64 if a.dtype != torch.float32 else 32) if on_gpu else 32
    grid = (blocks.block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, w, scale if scale is not None else topk_weights, out, blocks.sorted_pairs, blocks.block_expert,
        topk_weights, topk_weights.numel(), n, w.shape[2], top_k,
        a.stride(0), w.stride(0), w.stride(1), scale.stride(0) if scale is not None else 0, out.stride(0),
        BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GATE_UP=gate_up, W_INT8=scale is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST_DOT=_interpreting() and a.dtype == torch.bfloat16,
    )


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              experts: StackedExperts) -> torch.Tensor:
    """This rank's share of the MoE layer for ``x [T, H]`` (see :func:`supported`)."""
    num_tokens, top_k = topk_ids.shape
    inter = experts.w2.shape[2]
    hidden = experts.w2.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    blocks = align_by_expert(topk_ids, experts.expert_start, experts.num_experts,
                             _block_m(topk_ids.numel(), experts.num_experts))
    weights = topk_weights.reshape(-1).float().contiguous()
    act = torch.empty(blocks.sorted_pairs.numel(), inter, dtype=x.dtype, device=x.device)
    _launch(x, experts.w13, experts.w13_scale, act, blocks, weights, top_k, inter, gate_up=True)
    per_choice = torch.zeros(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    _launch(act, experts.w2, experts.w2_scale, per_choice, blocks, weights, top_k, hidden, gate_up=False)
    return per_choice.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
