"""The fused CPU MoE kernels (csrc/moe.cpp for fp32 activations, csrc/moe_bf16.cpp for bf16 ones, on AMX tiles and
on AVX512-BF16) against their spec, torch_ref.fused_moe, over routings that stress their grouping: every token to
one expert, experts with no tokens, one token, top-k = every expert, widths that are not multiples of the panels, and
choices whose experts are on another rank; and a packed MoE block against the same block running its per-expert
loop."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import torch_ref
from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.kernels.cpu import moe
from pagedserve.tests.unit.test_moe import HIDDEN, _block
from pagedserve.tests.utils import cpu_backend
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


bf16_kernel = pytest.mark.skipif(not moe.bf16_available(), reason="the bf16 MoE kernel needs AVX512-BF16")


def _check_bf16(x, w13, w2, ids, weights, start=0):
    """Both kernels (AMX, where the CPU has it, and AVX512-BF16) against the spec in bf16, which rounds where they do
    (gate, up, their product, down, the sum): they differ only in the order of fp32 sums, so by at most a bf16 step
    of the result or two of the spec's fp32 evaluation of the same rounded weights."""
    w13, w2, x = [w.bfloat16() for w in w13], [w.bfloat16() for w in w2], x.bfloat16()
    expected = torch_ref.fused_moe(x, w13, w2, ids, weights, start).float()
    exact = torch_ref.fused_moe(x.float(), [w.float() for w in w13], [w.float() for w in w2], ids, weights, start)
    packed = moe.pack_experts_bf16(w13, w2, start)
    outs = [moe.fused_moe_bf16(x, ids, weights, packed, use_amx=amx).float() for amx in (True, False)]
    scale = exact.abs().amax(-1, keepdim=True) + 1e-3
    for got in outs:
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert ((got - expected).abs() / scale).max() < 2 ** -6
        assert ((got - exact).abs() / scale).max() < 2 ** -5
    return outs[0]


@bf16_kernel
@pytest.mark.parametrize("hidden, inter", [(24, 40), (40, 37), (64, 8), (17, 1), (96, 64)])
def test_bf16_random_routings_equal_the_spec(hidden, inter):
    torch.manual_seed(hidden)
    w13, w2 = _experts(6, hidden, inter, seed=hidden)
    for tokens, k in ((1, 2), (7, 3), (33, 2), (5, 6)):
        x = torch.randn(tokens, hidden)
        ids = torch.stack([torch.randperm(6)[:k] for _ in range(tokens)])
        _check_bf16(x, w13, w2, ids, _routing(ids, tokens))


@bf16_kernel
def test_bf16_every_token_to_one_expert_and_experts_with_none():
    torch.manual_seed(1)
    w13, w2 = _experts(8, 64, 48, seed=1)
    x = torch.randn(50, 64)  # 50 rows on expert 3: AMX row groups of 32 and 16, the last one padded
    _check_bf16(x, w13, w2, torch.full((50, 1), 3), torch.ones(50, 1))
    ids = torch.stack([torch.tensor([3, 5])] * 50)
    _check_bf16(x, w13, w2, ids, _routing(ids, 2))


@bf16_kernel
def test_bf16_choices_on_other_ranks_add_nothing():
    torch.manual_seed(2)
    w13, w2 = _experts(3, 32, 40, seed=2)
    ids = torch.tensor([[0, 1], [4, 9], [5, 6], [2, 8], [6, 4]])
    got = _check_bf16(torch.randn(5, 32), w13, w2, ids, _routing(ids, 3), start=4)
    assert torch.equal(got[0], torch.zeros(32)) and torch.equal(got[3], torch.zeros(32))
    none_local = torch.tensor([[0, 1], [2, 3]])
    out = moe.fused_moe_bf16(torch.randn(2, 32).bfloat16(), none_local, _routing(none_local, 1),
                             moe.pack_experts_bf16([w.bfloat16() for w in w13], [w.bfloat16() for w in w2], 4))
    assert torch.equal(out, torch.zeros(2, 32, dtype=torch.bfloat16))


@bf16_kernel
def test_a_bf16_packed_block_equals_its_per_expert_loop():
    block = _block(6, 2, True).to(torch.bfloat16)
    x = torch.randn(13, HIDDEN).bfloat16()
    expected = block(x).float()
    assert pack_moe_experts(block, panels=False, bf16_panels=True) == 1
    assert len(block.experts) == 0 and isinstance(block.moe_panels, moe.MoeBF16Panels)
    got = block(x).float()
    assert ((got - expected).abs() / (expected.abs().amax(-1, keepdim=True) + 1e-3)).max() < 2 ** -6
    assert block(torch.empty(0, HIDDEN, dtype=torch.bfloat16)).shape == (0, HIDDEN)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts, k, renormalize", [(8, 2, True), (128, 8, False), (60, 4, True), (5, 5, False)])
def test_routing_kernel_equals_the_spec(dtype, experts, k, renormalize):
    """The same top-k logits and weights as torch_ref.select_experts; where bf16 logits tie, torch.topk's order is
    its algorithm's, the kernel's the lower id first: the chosen logits' values agree whatever the order."""
    logits = torch.randn(300, experts, generator=torch.Generator().manual_seed(experts)).to(dtype)
    expected = torch_ref.select_experts(logits, k, renormalize)
    got = moe.select_experts(logits, k, renormalize)
    assert got.experts.dtype == torch.int64 and got.weights.dtype == torch.float32
    assert torch.equal(logits.gather(1, got.experts), logits.gather(1, expected.experts))
    if dtype == torch.float32:  # no ties
        assert torch.equal(got.experts, expected.experts)
    torch.testing.assert_close(got.weights, expected.weights, rtol=1e-6, atol=1e-7)
    ties = (logits.gather(1, got.experts)[:, 1:] == logits.gather(1, got.experts)[:, :-1])
    rows, cols = ties.nonzero(as_tuple=True)
    assert (got.experts[rows, cols] < got.experts[rows, cols + 1]).all()


def test_the_cpu_backend_routes_in_its_kernel_and_falls_back_outside_it(caplog):
    backend = cpu_backend()
    logits = torch.randn(4, 8)
    torch.testing.assert_close(backend.select_experts(logits, 2, True).weights,
                               torch_ref.select_experts(logits, 2, True).weights)
    half = logits.half()  # no kernel for fp16 logits: the spec, logged once
    with caplog.at_level("INFO"):
        got = backend.select_experts(half, 2, True)
    assert torch.equal(got.experts, torch_ref.select_experts(half, 2, True).experts)
    assert "select_experts runs the torch reference" in caplog.text


def _quantized(weights: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    pairs = [torch_ref.quantize_int8(w) for w in weights]
    return [q for q, _ in pairs], [s for _, s in pairs]


@bf16_kernel
@pytest.mark.parametrize("hidden, inter", [(24, 40), (40, 37), (17, 1), (96, 64)])
def test_int8_experts_equal_the_spec(hidden, inter):
    """int8 panels (widened to bf16 a k step at a time on AMX, a panel at a time elsewhere) against the spec's
    int8 linears, as _check_bf16 measures; a single token, every token to one expert, experts on other ranks."""
    torch.manual_seed(hidden)
    w13, w2 = _experts(6, hidden, inter, seed=hidden)
    (q13, s13), (q2, s2) = _quantized(w13), _quantized(w2)
    packed = moe.pack_experts_int8(q13, s13, q2, s2, 2)
    assert packed.w13.dtype == torch.int8 and packed.w13_scale.shape == (6, packed.w13.shape[1], 32)
    for tokens, k in ((1, 2), (7, 3), (40, 1), (5, 6)):
        x = torch.randn(tokens, hidden).bfloat16()
        ids = torch.stack([torch.randperm(10)[:k] for _ in range(tokens)]) if tokens != 40 else torch.full((40, 1), 4)
        weights = _routing(ids, tokens)
        expected = torch_ref.fused_moe(x, q13, q2, ids, weights, 2, s13, s2).float()
        scale = expected.abs().amax(-1, keepdim=True) + 1e-3
        for amx in (True, False):
            got = moe.fused_moe_bf16(x, ids, weights, packed, use_amx=amx).float()
            assert ((got - expected).abs() / scale).max() < 2 ** -6


@bf16_kernel
def test_an_int8_block_packs_for_the_fused_kernel_and_equals_its_per_expert_loop():
    block = _block(6, 2, True).to(torch.bfloat16)
    for name, linear in block.named_modules():
        if name.endswith(("gate_up_proj", "down_proj")):
            q, s = torch_ref.quantize_int8(linear.weight.detach())
            linear.weight = torch.nn.Parameter(q, requires_grad=False)
            linear.weight_scale = torch.nn.Parameter(s, requires_grad=False)
    x = torch.randn(13, HIDDEN).bfloat16()
    expected = block(x).float()
    assert pack_moe_experts(block, panels=False, bf16_panels=True) == 1
    assert len(block.experts) == 0 and block.moe_panels.w13.dtype == torch.int8
    got = block(x).float()
    assert ((got - expected).abs() / (expected.abs().amax(-1, keepdim=True) + 1e-3)).max() < 2 ** -6
