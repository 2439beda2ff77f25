"""Attention over the paged KV cache; the kernel backend and the step's metadata come from the forward context."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.worker.forward_context import current_backend, get_attn_metadata


def layer_sliding_window(hf_config, layer_idx: int) -> int | None:
    """The sliding window of decoder layer ``layer_idx`` as Hugging Face applies it, or None for full attention:
    Mistral slides on every layer when ``sliding_window`` is set; configs with ``layer_types`` (Qwen2/3, Gemma 2/3)
    slide on their "sliding_attention" layers; Qwen2 configs without it on layers ``>= max_window_layers``."""
    window = getattr(hf_config, "sliding_window", None)
    if not isinstance(window, int) or not getattr(hf_config, "use_sliding_window", True):
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if getattr(hf_config, "model_type", None) == "mistral" or (layer_types is None and
                                                               not hasattr(hf_config, "max_window_layers")):
        return window
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window if layer_idx >= hf_config.max_window_layers else None


def kv_sliding_window(hf_config) -> int | None:
    """The window when every layer slides (KV blocks below it can be freed), else None."""
    windows = {layer_sliding_window(hf_config, i) for i in range(hf_config.num_hidden_layers)}
    return windows.pop() if len(windows) == 1 else None


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = scale
        # HF semantics: a query at position p attends keys at positions > p - sliding_window.
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # Per-tensor scales of an fp8 cache (cached = k / k_scale); other caches ignore them.
        self.k_scale, self.v_scale = 1.0, 1.0
        # Bound by the worker once the KV cache is allocated: [num_blocks, block_size, Hkv, D].
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        md, backend = get_attn_metadata(), current_backend()
        q = q.reshape(-1, self.num_heads, self.head_size)
        k = k.reshape(-1, self.num_kv_heads, self.head_size)
        v = v.reshape(-1, self.num_kv_heads, self.head_size)
        backend.reshape_and_cache(k, v, self.k_cache, self.v_cache, md.slot_mapping, self.k_scale, self.v_scale)
        out = backend.paged_attention(q, self.k_cache, self.v_cache, md.block_tables, md.query_start_loc, md.seq_lens,
                                      self.scale, sliding_window=self.sliding_window,
                                      logits_soft_cap=self.logits_soft_cap, k_scale=self.k_scale, v_scale=self.v_scale)
        return out.reshape(-1, self.num_heads * self.head_size)
