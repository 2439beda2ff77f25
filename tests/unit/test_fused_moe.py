"""The fused CPU MoE kernel (csrc/moe.cpp) against its spec, torch_ref.fused_moe, over routings that stress its
grouping: every token to one expert, experts with no tokens, one token, top-k = every expert, widths that are not
multiples of the panels, and choices whose experts are on another rank; and a packed MoE block against the same
block running its per-expert loop."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import torch_ref
from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.kernels.cpu import moe
from pagedserve.tests.unit.test_moe import HIDDEN, _block
from pagedserve.worker.cpu.moe_packing import pack_moe_experts

pytestmark = [pytest.mark.skipif(not cpu_extension.available(), reason="the C++ extension does not build here"),
              pytest.mark.usefixtures("cpu_kernels")]


def _experts(n: int, hidden: int, inter: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(2 * inter, hidden, generator=g) * 0.2 for _ in range(n)],
            [torch.randn(hidden, inter, generator=g) * 0.2 for _ in range(n)])


def _routing(ids: torch.Tensor, seed: int) -> torch.Tensor:
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) + 0.05
    return w / w.sum(-1, keepdim=True)


def _check(x, w13, w2, ids, weights, start=0):
    expected = torch_ref.fused_moe(x, w13, w2, ids, weights, start)
    got = moe.fused_moe(x, ids, weights, moe.pack_experts(w13, w2, start))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    return got


@pytest.mark.parametrize("hidden, inter", [(24, 40), (40, 37), (64, 8), (17, 1)])
def test_random_routings_equal_the_spec(hidden, inter):
    w13, w2 = _experts(6, hidden, inter, seed=hidden)
    for tokens, k in ((1, 2), (7, 3), (33, 2), (5, 6)):  # k = 6: every expert for every token
        x = torch.randn(tokens, hidden)
        ids = torch.stack([torch.randperm(6)[:k] for _ in range(tokens)])
        _check(x, w13, w2, ids, _routing(ids, tokens))


def test_every_token_to_one_expert_and_experts_with_none():
    w13, w2 = _experts(8, 24, 40, seed=1)
    x = torch.randn(50, 24)  # 50 rows on expert 3: tiles of 6 and a remainder
    ids = torch.full((50, 1), 3)
    _check(x, w13, w2, ids, torch.ones(50, 1))
    ids = torch.stack([torch.tensor([3, 5])] * 50)
    _check(x, w13, w2, ids, _routing(ids, 2))


def test_choices_on_other_ranks_add_nothing():
    """This rank holds experts 4..6 of 10: tokens with none of them get zeros, the others only their local share."""
    w13, w2 = _experts(3, 24, 40, seed=2)
    ids = torch.tensor([[0, 1], [4, 9], [5, 6], [2, 8], [6, 4]])
    got = _check(torch.randn(5, 24), w13, w2, ids, _routing(ids, 3), start=4)
    assert torch.equal(got[0], torch.zeros(24)) and torch.equal(got[3], torch.zeros(24))


def test_a_packed_block_equals_its_per_expert_loop():  # fp32 values: fp32 panels
    block = _block(6, 2, True)
    x = torch.randn(13, HIDDEN)
    expected = block(x)
    assert pack_moe_experts(block, panels=True) == 1
    assert len(block.experts) == 0 and block.moe_panels is not None
    torch.testing.assert_close(block(x), expected, rtol=1e-6, atol=1e-6)
    assert block(torch.empty(0, HIDDEN)).shape == (0, HIDDEN)


def test_bf16_panels_of_bf16_valued_experts_give_the_fp32_panels_sums():
    w13, w2 = _experts(5, 40, 37, seed=4)
    w13 = [w.bfloat16().float() for w in w13]  # a bf16 checkpoint, run in fp32
    w2 = [w.bfloat16().float() for w in w2]
    assert moe.exact_in_bf16(w13 + w2) and not moe.exact_in_bf16([torch.randn(3, 3)])
    x = torch.randn(9, 40)
    ids = torch.stack([torch.randperm(5)[:2] for _ in range(9)])
    weights = _routing(ids, 5)
    fp32 = moe.fused_moe(x, ids, weights, moe.pack_experts(w13, w2, 0))
    packed = moe.pack_experts(w13, w2, 0, torch.bfloat16)
    assert packed.w13.dtype == torch.bfloat16 and packed.w13.element_size() == 2
    assert torch.equal(moe.fused_moe(x, ids, weights, packed), fp32)
    _check(x, w13, w2, ids, weights)
