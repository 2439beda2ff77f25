"""Rotary position embeddings (GPT-NeoX / rotate-half layout), optionally on the first dims only."""
from __future__ import annotations

import math

import torch
from torch import nn

from pagedserve.worker.forward_context import current_backend, get_attn_metadata


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

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D], rotated (the backend's kernel may do it in place)."""
        positions = positions.long().contiguous()
        return current_backend().rotary(positions, q, k, self.cos, self.sin, self.rotary_dim)


class LongRopeRotaryEmbedding(RotaryEmbedding):
    """Phi-3's LongRoPE: frequencies divided by per-dim short factors, or by the long factors for every token of a
    sequence whose length this step (``seq_lens``) exceeds ``original_max_position_embeddings``, as HF decides per
    forward; cos and sin are scaled by the attention factor. The long table sits after the short one."""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float, p: dict) -> None:
        nn.Module.__init__(self)
        self.head_size, self.rotary_dim = head_size, rotary_dim
        self.original_max = p["original_max_position_embeddings"]
        factor = p.get("factor") or max_position / self.original_max
        scale = p.get("attention_factor")
        if scale is None:
            scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(self.original_max))
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        pos = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.cat([torch.outer(pos, 1.0 / (torch.tensor(p[key], dtype=torch.float32) * base**exponents))
                           for key in ("short_factor", "long_factor")])
        self.long_offset = max_position
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        md = get_attn_metadata()
        offset = (md.seq_lens > self.original_max).long() * self.long_offset
        offset = torch.repeat_interleave(offset, md.query_start_loc.diff().long())
        if offset.numel() < positions.numel():  # padded rows past the last sequence
            offset = torch.cat([offset, offset.new_zeros(positions.numel() - offset.numel())])
        return super().forward(positions + offset.to(positions.device), q, k)


def _for_layer(params: dict | None, layer_type: str | None) -> dict:
    """Gemma 3 nests the parameters by layer type ("sliding_attention", "full_attention")."""
    params = params or {}
    return dict(params[layer_type]) if layer_type and isinstance(params.get(layer_type), dict) else dict(params)


def rope_from_config(hf_config, head_size: int, rotary_dim: int | None = None,
                     layer_type: str | None = None) -> RotaryEmbedding:
    """Reads both the transformers v5 ``rope_parameters`` and the older ``rope_scaling``/``rope_theta``;
    ``layer_type`` picks a layer type's own parameters where the config has them per type."""
    params = _for_layer(getattr(hf_config, "rope_parameters", None), layer_type)
    params.update(_for_layer(getattr(hf_config, "rope_scaling", None), layer_type))
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", None)
                      or getattr(hf_config, "rotary_emb_base", 10000.0))
    if rotary_dim is None:
        factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None)
                            or getattr(hf_config, "rotary_pct", 1.0))
        rotary_dim = int(head_size * factor)
    if params.get("rope_type", params.get("type")) in ("longrope", "su"):
        params.setdefault("original_max_position_embeddings", hf_config.original_max_position_embeddings)
        return LongRopeRotaryEmbedding(head_size, rotary_dim, hf_config.max_position_embeddings, base, params)
    return RotaryEmbedding(head_size, rotary_dim, hf_config.max_position_embeddings, base, params)
