"""A rank's side of a KV handoff between replicas: the KV of some cache blocks read out with a digest of each
block's bytes, and written into other blocks only where the digest of what arrived matches."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass
class KVBlockData:
    """One rank's KV of ``n`` blocks over every layer, ``k``, ``v [layers, n, block_size, kv_heads, head_size]`` on
    the CPU, and each block's digest as read."""

    k: torch.Tensor
    v: torch.Tensor
    digests: list[bytes]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def block_digests(k: torch.Tensor, v: torch.Tensor) -> list[bytes]:
    """blake2b over each block's K and V bytes, every layer."""
    def raw(t: torch.Tensor) -> bytes:
        return t.contiguous().view(torch.uint8).numpy().tobytes()

    out = []
    for i in range(k.shape[1]):
        h = hashlib.blake2b(digest_size=16)
        h.update(raw(k[:, i]))
        h.update(raw(v[:, i]))
        out.append(h.digest())
    return out


def read_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block_ids: list[int]) -> KVBlockData:
    index = torch.tensor(block_ids, dtype=torch.long, device=k_caches[0].device)
    k = torch.stack([c.index_select(0, index) for c in k_caches]).cpu()
    v = torch.stack([c.index_select(0, index) for c in v_caches]).cpu()
    return KVBlockData(k, v, block_digests(k, v))


def write_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block_ids: list[int],
                 data: KVBlockData) -> int:
    """Write the leading blocks whose bytes match their digests into ``block_ids``; returns how many (a block that
    does not match, and every one after it, is left out: its KV would be wrong)."""
    good = 0
    for want, got in zip(data.digests, block_digests(data.k, data.v)):
        if want != got:
            break
        good += 1
    good = min(good, len(block_ids))
    if good:
        index = torch.tensor(block_ids[:good], dtype=torch.long, device=k_caches[0].device)
        for layer, (kc, vc) in enumerate(zip(k_caches, v_caches)):
            kc.index_copy_(0, index, data.k[layer, :good].to(kc.device))
            vc.index_copy_(0, index, data.v[layer, :good].to(vc.device))
    return good
