from __future__ import annotations

import torch
from torch import nn

from pagedserve.worker.forward_context import current_backend


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add: ``norm(x + residual)`` and the new residual.

    The backend's kernel may work in place: ``residual`` becoming ``x + residual`` and ``x`` its normalized copy (the
    decoder layers hand over buffers they no longer read).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return current_backend().rms_norm(x, self.weight, self.eps)
        return current_backend().fused_add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by ``1 + weight`` and, unlike LLaMA's, multiplies in fp32 before casting back."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
