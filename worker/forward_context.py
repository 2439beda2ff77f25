"""Per-step attention metadata, visible to every Attention layer during one forward pass."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context incl. this step's tokens
    backend: ModuleType


_CONTEXT: AttentionMetadata | None = None


def get_attn_metadata() -> AttentionMetadata:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: run the model through the model runner")
    return _CONTEXT


@contextmanager
def set_forward_context(metadata: AttentionMetadata):
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, metadata
    try:
        yield
    finally:
        _CONTEXT = prev
