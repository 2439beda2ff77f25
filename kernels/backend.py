"""The kernel backend: every op a model step runs (attention and the KV-cache writes and copies, norms, rotary,
activation, row gathers, sampling, linears), behind one object a worker chooses once (``kernels/select.py``) and its
layers reach through the forward context.

:class:`KernelBackend` is the ``torch`` backend and the base of the others: each op is the one of
:mod:`~pagedserve.kernels.torch_ref`, the spec. A fast backend (``cpu/backend.py``, ``triton/backend.py``) overrides
the ops it has kernels for; an op whose kernel cannot run for the whole model (a dtype it does not take, the C++
extension not built) is set to the spec at load, and an op whose kernel does not take one call's arguments runs the
spec for that call. Either way the fallback is logged once per op, with its reason.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import torch_ref

logger = logging.getLogger(__name__)

# The most rows of output a linear keeps between calls (``reuse_out``): a decode batch's logits, not a prompt's.
REUSED_OUT_ROWS = 256


@dataclass(frozen=True)
class PackingPlan:
    """Which of the C++ panel GEMMs a CPU model's linear weights are packed for (``worker/cpu/packing.py``); each
    None: where the CPU and the built extension run it. Weights no panel GEMM takes go to oneDNN's layout."""

    panels: bool | None = None  # fp32
    bf16_panels: bool | None = None
    int8_panels: bool | None = None


@dataclass(frozen=True)
class LocalExperts:
    """One MoE layer's experts on this rank as loaded: ``gate_up[i] [2I, H]`` (gate rows, then up rows) and
    ``down[i] [H, I]`` of expert ``expert_start + i``; int8 ones with their fp32 per-row scales."""

    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    expert_start: int
    gate_up_scale: list[torch.Tensor] | None = None
    down_scale: list[torch.Tensor] | None = None


class KernelBackend:
    """The torch backend: the spec's ops, and ``F.linear`` (on CPU through weights oneDNN packed at load)."""

    name = "torch"
    # Whether a LLaMA-shaped model may run each decoder layer as one call of this backend's ``llama_layer``.
    fused_decoder_layer = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._logged: set[tuple[str, str]] = set()

    def fallback(self, op: str, reason: str) -> None:
        """Note that ``op`` runs the torch reference, for ``reason``: logged the first time each pair is seen."""
        if (op, reason) not in self._logged:
            self._logged.add((op, reason))
            logger.info("%s backend: %s runs the torch reference: %s", self.name, op, reason)

    def packing(self) -> PackingPlan | None:
        """How the model's linear weights are reordered once after loading for :meth:`linear` (None: not at all)."""
        return PackingPlan(panels=False, bf16_panels=False, int8_panels=False) if self.device.type == "cpu" else None

    # ---- attention and the KV cache ----------------------------------------------------------
    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
        torch_ref.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def paged_attention(self, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out=None, *,
                        sliding_window=None, logits_soft_cap=None, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
        return torch_ref.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out,
                                         sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                         k_scale=k_scale, v_scale=v_scale)

    def copy_blocks(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                    block_mapping: torch.Tensor) -> None:
        torch_ref.copy_blocks(k_caches, v_caches, block_mapping)

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
        torch_ref.swap_blocks(src, dst, block_mapping)

    # ---- element-wise ------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch_ref.rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; may overwrite ``x`` and ``residual`` (the layers hand over
        buffers they no longer read)."""
        return torch_ref.fused_add_rms_norm(x, residual, weight, eps)

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotated ``(q, k)``; may rotate them in place."""
        return torch_ref.rotary(positions, q, k, cos, sin, rotary_dim)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return torch_ref.silu_and_mul(x)

    def gather_rows(self, src: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch_ref.gather_rows(src, ids)

    # ---- sampling ----------------------------------------------------------------------------
    def apply_token_bitmask(self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        return torch_ref.apply_token_bitmask(logits, rows, bitmask)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch_ref.argmax(x)

    def sample_rows(self, logits, temperature, top_k, top_p, min_p, uniform, greedy) -> torch.Tensor:
        return torch_ref.sample_rows(logits, temperature, top_k, top_p, min_p, uniform, greedy)

    # ---- mixture of experts ------------------------------------------------------------------
    def select_experts(self, router_logits: torch.Tensor, top_k: int, renormalize: bool) -> torch_ref.ExpertRouting:
        return torch_ref.select_experts(router_logits, top_k, renormalize)

    def pack_experts(self, experts: LocalExperts) -> object | None:
        """The layout :meth:`moe_experts` reads for one MoE layer, made once after loading; None: the block keeps its
        expert modules. (The CPU backend's panels are packed by ``worker/cpu``, on huge pages.)"""
        return None

    def moe_experts(self, block: nn.Module, x: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor) -> torch.Tensor:
        """This rank's share of a MoE layer (``torch_ref.fused_moe``): here the block's own loop over its local
        experts, each a pair of linears through :meth:`linear`."""
        return block.run_experts(x, topk_ids, topk_weights)

    # ---- linear ------------------------------------------------------------------------------
    def linear(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
               out_dtype: torch.dtype | None = None, reuse_out: bool = False) -> torch.Tensor:
        """``x @ layer.weight.T + bias`` through the weight packing (:meth:`packing`) left on the layer: int8 with its
        ``weight_scale`` (the spec's int8 linear), oneDNN's ``packed_weight``, else the plain weight. ``out_dtype``
        float32 asks for fp32 outputs (logits) where a kernel gives them without a rounding step; ``reuse_out``: the
        caller is done with the result before its next call, so a kernel may write into a buffer the layer keeps."""
        scale = getattr(layer, "weight_scale", None)
        if scale is not None:
            return torch_ref.int8_linear(x, layer.weight, scale, bias, out_dtype)
        packed = getattr(layer, "packed_weight", None)
        if packed is None:
            return F.linear(x, layer.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

