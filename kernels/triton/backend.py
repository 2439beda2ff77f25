"""The Triton backend (CUDA): paged attention and the KV-cache writes and copies (``ops.py``) and the MoE experts
(``moe.py``) in Triton kernels; the spec (torch on the GPU) for the rest."""
from __future__ import annotations

import torch

from pagedserve.kernels.backend import KernelBackend, LocalExperts
from pagedserve.kernels.triton import moe, ops


class TritonBackend(KernelBackend):
    name = "triton"

    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
        ops.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def paged_attention(self, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out=None, *,
                        sliding_window=None, logits_soft_cap=None, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
        if not ops.attention_supported(query, k_cache):
            self.fallback("paged_attention", f"its kernel's tiles take head sizes 9 to 256, not {query.shape[2]}")
        return ops.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out,
                                   sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                   k_scale=k_scale, v_scale=v_scale)

    def copy_blocks(self, k_caches, v_caches, block_mapping) -> None:
        ops.copy_blocks(k_caches, v_caches, block_mapping)

    def swap_blocks(self, src, dst, block_mapping) -> None:
        ops.swap_blocks(src, dst, block_mapping)

    def pack_experts(self, experts: LocalExperts) -> moe.StackedExperts:
        return moe.stack_experts(experts.gate_up, experts.down, experts.expert_start, experts.gate_up_scale,
                                 experts.down_scale)

    def moe_experts(self, block, x, topk_ids, topk_weights):
        stacked = block.moe_panels
        if not isinstance(stacked, moe.StackedExperts):
            return super().moe_experts(block, x, topk_ids, topk_weights)
        if not moe.supported(x, stacked):
            self.fallback("moe_experts", f"its kernels take [tokens, hidden] activations of the experts' float dtype, "
                                         f"not {x.dtype} {tuple(x.shape)} on {stacked.w13.dtype} experts")
            return moe.reference(x, topk_ids, topk_weights, stacked)
        return moe.fused_moe(x, topk_ids, topk_weights, stacked)
