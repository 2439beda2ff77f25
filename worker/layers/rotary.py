"""Rotary position embeddings (GPT-NeoX / rotate-half layout), optionally on the first dims only."""
from __future__ import annotations

import math

import torch
from torch import nn

from pagedserve.kernels import cpu_fused


def _inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _llama3_scale(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float,
                 rope_parameters: dict | None = None) -> None:
        super().__init__()
        self.head_size, self.rotary_dim = head_size, rotary_dim
        p = dict(rope_parameters or {})
        rope_type = p.get("rope_type", p.get("type", "default"))
        inv_freq = _inv_freq(rotary_dim, base)
        if rope_type == "linear":
            inv_freq = inv_freq / p["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_scale(inv_freq, p)
        elif rope_type != "default":
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, linear, llama3")
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H, head_size]; cos/sin: [T, 1, rotary_dim / 2]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D]; on CPU (fp32, bf16) rotated in place by one C++ pass and returned."""
        positions = positions.long().contiguous()
        if cpu_fused.rotary_supported(positions, q, k, self.cos, self.sin, self.rotary_dim):
            cpu_fused.rotary(positions, q, k, self.cos, self.sin, self.rotary_dim)
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


def rope_from_config(hf_config, head_size: int, rotary_dim: int | None = None) -> RotaryEmbedding:
    """Reads both the transformers v5 ``rope_parameters`` and the older ``rope_scaling``/``rope_theta``."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    params.update(getattr(hf_config, "rope_scaling", None) or {})
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", None)
                      or getattr(hf_config, "rotary_emb_base", 10000.0))
    if rotary_dim is None:
        factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None)
                            or getattr(hf_config, "rotary_pct", 1.0))
        rotary_dim = int(head_size * factor)
    return RotaryEmbedding(head_size, rotary_dim, hf_config.max_position_embeddings, base, params)
