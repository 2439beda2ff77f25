"""A rank's side of a KV handoff between replicas: the KV of some cache blocks read out, and written into others."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVBlockData:
    """One rank's KV of ``n`` blocks over every layer, ``k``, ``v [layers, n, block_size, kv_heads, head_size]`` on
    the CPU; ``digests``: each block's checksum as the producer read it (``engine/kv_transfer.py``)."""

    k: torch.Tensor
    v: torch.Tensor
    digests: list[bytes] | None = None

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def head(self, n: int) -> KVBlockData:
        """The first ``n`` blocks."""
        return KVBlockData(self.k[:, :n], self.v[:, :n], None if self.digests is None else self.digests[:n])


def read_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block_ids: list[int]) -> KVBlockData:
    index = torch.tensor(block_ids, dtype=torch.long, device=k_caches[0].device)
    return KVBlockData(torch.stack([c.index_select(0, index) for c in k_caches]).cpu(),
                       torch.stack([c.index_select(0, index) for c in v_caches]).cpu())


def write_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block_ids: list[int],
                 data: KVBlockData) -> int:
    """Write the blocks of ``data`` into ``block_ids`` (as many as both have); returns how many."""
    n = min(data.num_blocks, len(block_ids))
    if n:
        index = torch.tensor(block_ids[:n], dtype=torch.long, device=k_caches[0].device)
        for layer, (kc, vc) in enumerate(zip(k_caches, v_caches)):
            kc.index_copy_(0, index, data.k[layer, :n].to(kc.device))
            vc.index_copy_(0, index, data.v[layer, :n].to(vc.device))
    return n
