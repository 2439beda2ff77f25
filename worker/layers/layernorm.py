from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels import cpu_fused


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add: ``norm(x + residual)`` and the new residual.

    On CPU (fp32, bf16) one C++ pass does both; with a residual it works in place: ``residual`` becomes
    ``x + residual`` and ``x`` its normalized copy (the decoder layers hand over buffers they no longer read).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return cpu_fused.rms_norm(x, self.weight, self.eps) if cpu_fused.rms_norm_supported(x, self.weight) \
                else self._norm(x)
        if cpu_fused.rms_norm_supported(x, self.weight, residual):
            cpu_fused.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        x = x + residual
        return self._norm(x), x


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
