"""The CPU backend: the C++ kernels (``csrc/``) for attention, the KV-cache writes, the element-wise ops, sampling and
the panel GEMMs, and the one-call LLaMA decoder layer; the spec for the rest."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.backend import REUSED_OUT_ROWS, KernelBackend, PackingPlan
from pagedserve.kernels.cpu import attention, extension, fused, gemm, gemm_bf16, gemm_int8, layer, moe

# The activations the C++ attention, norms, rotary, activation and cache writes take.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_ACTIVATION_OPS = ("reshape_and_cache", "paged_attention", "rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul")


def _describe(*tensors: torch.Tensor) -> str:
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} stride {list(t.stride())}"
                     for t in tensors)


class CpuBackend(KernelBackend):
    """``dtype``: the model's activations. Builds the C++ extension at once: a failed build raises, naming
    ``--attention-backend torch``."""

    name = "cpu"
    fused_decoder_layer = True

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(device)
        self._outside_ops: set[str] = set()
        extension.load()
        if dtype not in KERNEL_DTYPES:
            for op in _ACTIVATION_OPS:
                self._use_spec(op, f"its kernel takes float32 and bfloat16, the model runs {dtype}")

    def _use_spec(self, op: str, reason: str) -> None:
        """Run the spec's ``op`` for the whole model, from now on."""
        setattr(self, op, getattr(KernelBackend, op).__get__(self))
        self.fallback(op, reason)

    def _outside(self, op: str, *tensors: torch.Tensor) -> None:
        """One call's arguments that the kernel does not take: that call runs the spec (logged for the op's first)."""
        if op not in self._outside_ops:
            self._outside_ops.add(op)
            self.fallback(op, f"arguments outside its kernel's preconditions, first {_describe(*tensors)}")

    def packing(self) -> PackingPlan:
        return PackingPlan()

    # ---- attention and the KV cache ----------------------------------------------------------
    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
        if fused.reshape_and_cache_supported(key, value, k_cache, v_cache):
            fused.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping.long(), k_scale, v_scale)
            return
        self._outside("reshape_and_cache", key, k_cache)
        super().reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def paged_attention(self, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out=None, *,
                        sliding_window=None, logits_soft_cap=None, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
        if attention.supports(query, k_cache):
            if query.stride(1) != query.shape[2]:
                query = query.contiguous()
            return attention.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                             scale, out, sliding_window=sliding_window,
                                             logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale)
        self._outside("paged_attention", query, k_cache)
        return super().paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out,
                                       sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                       k_scale=k_scale, v_scale=v_scale)

    # ---- element-wise ------------------------------------------------------------------------
    def rms_norm(self, x, weight, eps):
        if fused.rms_norm_supported(x, weight):
            return fused.rms_norm(x, weight, eps)
        self._outside("rms_norm", x, weight)
        return super().rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        if fused.rms_norm_supported(x, weight, residual):
            fused.fused_add_rms_norm(x, residual, weight, eps)
            return x, residual
        self._outside("fused_add_rms_norm", x, residual, weight)
        return super().fused_add_rms_norm(x, residual, weight, eps)

    def rotary(self, positions, q, k, cos, sin, rotary_dim):
        if fused.rotary_supported(positions, q, k, cos, sin, rotary_dim):
            fused.rotary(positions, q, k, cos, sin, rotary_dim)
            return q, k
        self._outside("rotary", positions, q, k, cos)
        return super().rotary(positions, q, k, cos, sin, rotary_dim)

    def silu_and_mul(self, x):
        if fused.silu_and_mul_supported(x):
            return fused.silu_and_mul(x)
        self._outside("silu_and_mul", x)
        return super().silu_and_mul(x)

    def gather_rows(self, src, ids):
        if fused.gather_rows_supported(src, ids):
            return fused.gather_rows(src, ids)
        self._outside("gather_rows", src, ids)
        return super().gather_rows(src, ids)

    # ---- sampling ----------------------------------------------------------------------------
    def apply_token_bitmask(self, logits, rows, bitmask):
        if fused.apply_token_bitmask_supported(logits, rows, bitmask):
            return fused.apply_token_bitmask(logits, rows, bitmask)
        self._outside("apply_token_bitmask", logits, rows, bitmask)
        return super().apply_token_bitmask(logits, rows, bitmask)

    def argmax(self, x):
        if fused.argmax_supported(x):
            return fused.argmax(x)
        self._outside("argmax", x)
        return super().argmax(x)

    def sample_rows(self, logits, temperature, top_k, top_p, min_p, uniform, greedy):
        if fused.sample_supported(logits):
            return fused.sample(logits, temperature, top_k, top_p, min_p, uniform, greedy)
        self._outside("sample_rows", logits)
        return super().sample_rows(logits, temperature, top_k, top_p, min_p, uniform, greedy)

    # ---- mixture of experts ------------------------------------------------------------------
    def select_experts(self, router_logits, top_k, renormalize):
        if moe.routing_supported(router_logits, top_k):
            return moe.select_experts(router_logits, top_k, renormalize)
        self._outside("select_experts", router_logits)
        return super().select_experts(router_logits, top_k, renormalize)

    def moe_experts(self, block, x, topk_ids, topk_weights):
        """One C++ call where packing gave the block fused-MoE panels (``worker/cpu/moe_packing.py``), else the
        block's loop over its experts."""
        panels = getattr(block, "moe_panels", None)
        if panels is None:
            return super().moe_experts(block, x, topk_ids, topk_weights)
        # The panels replaced the experts' weights: nothing else can run them.
        if isinstance(panels, moe.MoeBF16Panels):
            if not moe.bf16_supported(x):
                raise TypeError(f"the bf16 MoE panels take bfloat16 [tokens, hidden] activations, got {_describe(x)}")
            return moe.fused_moe_bf16(x, topk_ids, topk_weights, panels)
        if not moe.supported(x):
            raise TypeError(f"the fused MoE panels take float32 [tokens, hidden] activations, got {_describe(x)}")
        return moe.fused_moe(x, topk_ids, topk_weights, panels)

    # ---- linear and the one-call layer -------------------------------------------------------
    def linear(self, layer_: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
               out_dtype: torch.dtype | None = None, reuse_out: bool = False) -> torch.Tensor:
        """Through the layer's panels where packing gave it some (a new output of tens of MB, the logits of 64+
        rows, comes from mmap, and faulting its pages in made the LM head ~1.6x slower: hence ``reuse_out``)."""
        panels = getattr(layer_, "panel_weight", None)
        if panels is None:
            return super().linear(layer_, x, bias, out_dtype, reuse_out)
        dtype = torch.float32 if isinstance(panels, gemm.PanelWeight) else out_dtype or x.dtype
        out = _reused_out(layer_, x, panels.out_features, dtype) if reuse_out else None
        if isinstance(panels, gemm_int8.Int8PanelWeight):
            return gemm_int8.gemm(x, panels, bias, dtype, out=out)
        if isinstance(panels, gemm_bf16.BF16PanelWeight):
            return gemm_bf16.gemm(x, panels, bias, dtype, out=out)
        return gemm.gemm(x, panels, bias, out=out)

    def llama_layer(self, weights: layer.LayerWeights, x, residual, positions, k_cache, v_cache, md, k_scale,
                    v_scale):
        """A whole LLaMA decoder layer in one call (``layer.py``), bitwise the module path's."""
        return layer.llama_layer(weights, x, residual, positions, k_cache, v_cache, md, k_scale, v_scale)


def _reused_out(layer_: nn.Module, x: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The first rows of the layer's kept ``[REUSED_OUT_ROWS, n]`` output buffer, one for each of ``x``'s rows; None
    (a new output) for more rows."""
    rows = x.numel() // x.shape[-1]
    if rows > REUSED_OUT_ROWS:
        return None
    buf = getattr(layer_, "reused_out", None)
    if buf is None or buf.dtype != dtype:
        buf = layer_.reused_out = torch.empty(REUSED_OUT_ROWS, n, dtype=dtype)
    return buf[:rows]

