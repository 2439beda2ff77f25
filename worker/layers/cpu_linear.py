"""Linear layers on CPU through oneDNN with each weight reordered once, after loading, into its blocked layout.

``F.linear`` (MKL sgemm) repacks the weight on every call; at decode batch sizes that repacking is a large share of
the call. The packed weight replaces the plain one (same memory), so the module keeps a ``weight`` only where it
is shared (a tied LM head stays on ``F.linear``).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """Dtypes oneDNN runs natively here; others keep ``F.linear`` (bf16 on AVX2 would be emulated, slowly)."""
    if not torch.backends.mkldnn.is_available():
        return ()
    dtypes = [torch.float32]
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtypes.append(torch.bfloat16)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        dtypes.append(torch.float16)
    return tuple(dtypes)


def linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = getattr(layer, "packed_weight", None)
    if packed is None:
        return F.linear(x, layer.weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_linears(model: nn.Module, batch_hint: int = 128) -> int:
    """Pack every linear weight that only its layer uses; returns how many were packed."""
    dtypes = packable_dtypes()
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    packed = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not getattr(module, "packable", False) or w is None or w.device.type != "cpu" or w.dim() != 2:
            continue
        if w.dtype not in dtypes or counts.get(id(w), 0) != 1:
            continue
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
        module.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)  # freed: packed holds it
        packed += 1
    if packed:
        logger.info("packed %d linear weights for oneDNN (%s)", packed, ", ".join(map(str, dtypes)))
    return packed
