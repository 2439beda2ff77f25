"""What every layer sees during one forward pass: the step's attention metadata and the worker's kernel backend."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedserve.kernels.backend import KernelBackend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context incl. this step's tokens


@dataclass
class ForwardContext:
    backend: KernelBackend
    attn_metadata: AttentionMetadata | None = None  # None outside a model step (a layer run alone)


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: run the model through the model runner (or set_forward_context)")
    return _CONTEXT


def get_attn_metadata() -> AttentionMetadata:
    md = get_forward_context().attn_metadata
    if md is None:
        raise RuntimeError("no attention metadata in this forward context")
    return md


def current_backend() -> KernelBackend:
    return get_forward_context().backend


@contextmanager
def set_forward_context(context: ForwardContext):
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, context
    try:
        yield
    finally:
        _CONTEXT = prev
