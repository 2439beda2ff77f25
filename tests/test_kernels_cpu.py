"""The C++ CPU decode-attention kernel against the torch reference."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_attention, get_backend, torch_ref


@pytest.fixture(scope="module", autouse=True)
def built():
    if cpu_attention.load() is None:
        pytest.fail("the CPU attention kernel did not build (is a C++ compiler installed?)")


@pytest.mark.parametrize("gqa", [1, 2, 4])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 128])
def test_decode_matches_reference(gqa, block_size, head_size):
    g = torch.Generator().manual_seed(gqa * 1000 + block_size + head_size)
    hkv = 2
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size, 77]
    blocks = sum(-(-n // block_size) for n in lens) + 3
    k = torch.randn(blocks, block_size, hkv, head_size, generator=g)
    v = torch.randn(blocks, block_size, hkv, head_size, generator=g)
    perm = torch.randperm(blocks, generator=g)
    table = torch.zeros(len(lens), max(-(-n // block_size) for n in lens), dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        table[i, :nb] = perm[used: used + nb]
        used += nb
    q = torch.randn(len(lens), hkv * gqa, head_size, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ref = torch_ref._decode_attention(q, k, v, table, seq_lens, 0.125)
    got = cpu_attention.paged_decode_attention(q, k, v, table, seq_lens, 0.125)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_cpu_backend_mixed_batch_matches_reference():
    """Prefill chunks go through the shared reference path, decodes through the kernel."""
    g = torch.Generator().manual_seed(7)
    k = torch.randn(12, 16, 2, 64, generator=g)
    v = torch.randn(12, 16, 2, 64, generator=g)
    table = torch.tensor([[3, 1, 7], [0, 2, 0], [5, 9, 11]], dtype=torch.int32)
    q_lens, seq_lens = [1, 20, 1], [40, 20, 33]
    qsl = torch.tensor([0, 1, 21, 22], dtype=torch.int32)
    q = torch.randn(sum(q_lens), 4, 64, generator=g)
    args = (q, k, v, table, qsl, torch.tensor(seq_lens, dtype=torch.int32), 0.125)
    backend = get_backend("cpu")
    assert backend.__name__.endswith("cpu_ops")
    torch.testing.assert_close(backend.paged_attention(*args), torch_ref.paged_attention(*args), atol=2e-5, rtol=1e-5)
