"""The MoE block: each family's routing normalisation, the grouped-by-expert path against a per-token reference,
expert shards over TP ranks (unequal when the count does not divide), and each rank loading only its experts."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.torch_ref import select_experts
from pagedserve.tests.utils import load_as_rank
from pagedserve.worker import parallel_state
from pagedserve.worker.cpu.decoder_layer import CPUDecoderLayers
from pagedserve.worker.layers.moe import SparseMoeBlock, local_experts

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # layers run alone, on the C++ kernels

HIDDEN, INTER = 24, 40  # not multiples of 16


def test_mixtral_routing_is_softmax_over_top_k_logits():
    logits = torch.randn(9, 6)
    r = select_experts(logits, 2, renormalize=True)
    top = logits.topk(2, dim=-1)
    assert torch.equal(r.experts, top.indices)
    torch.testing.assert_close(r.weights, torch.softmax(top.values, dim=-1))


def test_qwen3_moe_routing_without_norm_keeps_full_softmax_mass():
    logits = torch.randn(9, 6)
    probs = torch.softmax(logits, dim=-1)
    r = select_experts(logits, 3, renormalize=False)
    torch.testing.assert_close(r.weights, probs.topk(3, dim=-1).values)
    assert (r.weights.sum(-1) < 1).all()
    normed = select_experts(logits, 3, renormalize=True)
    torch.testing.assert_close(normed.weights.sum(-1), torch.ones(9))


def _block(num_experts: int, top_k: int, renormalize: bool, rank: int = 0, tp: int = 1,
           seed: int = 0) -> SparseMoeBlock:
    parallel_state._TP_RANK, parallel_state._TP_SIZE = rank, tp
    try:
        block = SparseMoeBlock(HIDDEN, INTER, num_experts, top_k, renormalize)
    finally:
        parallel_state._TP_RANK, parallel_state._TP_SIZE = 0, 1
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(num_experts, HIDDEN, generator=g))
        for e in range(num_experts):  # every rank draws all experts, keeps its own: shards of one model
            gate_up = torch.randn(2 * INTER, HIDDEN, generator=g) * 0.2
            down = torch.randn(HIDDEN, INTER, generator=g) * 0.2
            if str(e) in block.experts:
                block.experts[str(e)].gate_up_proj.weight.copy_(gate_up)
                block.experts[str(e)].down_proj.weight.copy_(down)
    return block


def _per_token_reference(block: SparseMoeBlock, x: torch.Tensor, experts_of: list[int]) -> torch.Tensor:
    """Token by token, expert by expert: sum_k w_k * down(silu(gate(x)) * up(x)) over the listed experts."""
    r = select_experts(F.linear(x, block.gate.weight), block.top_k, block.renormalize)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(r.weights[t].tolist(), r.experts[t].tolist()):
            if e in experts_of:
                expert = block.experts[str(e)]
                gate, up = F.linear(x[t], expert.gate_up_proj.weight).chunk(2)
                out[t] += w * F.linear(F.silu(gate) * up, expert.down_proj.weight)
    return out


@pytest.mark.parametrize("num_experts, top_k, renormalize", [(4, 2, True), (6, 2, False), (5, 3, True)])
def test_grouped_experts_equal_per_token_loop(num_experts, top_k, renormalize):
    block = _block(num_experts, top_k, renormalize)
    for tokens in (1, 7, 33):
        x = torch.randn(tokens, HIDDEN)
        torch.testing.assert_close(block(x), _per_token_reference(block, x, list(range(num_experts))),
                                   rtol=1e-5, atol=1e-5)
    assert block(torch.empty(0, HIDDEN)).shape == (0, HIDDEN)


@pytest.mark.parametrize("num_experts, tp", [(4, 2), (5, 2), (3, 2), (7, 3), (2, 3)])
def test_expert_shards_cover_all_and_sum_to_the_full_block(num_experts, tp):
    shards = [local_experts(num_experts, r, tp) for r in range(tp)]
    assert [e for s in shards for e in s] == list(range(num_experts))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    full = _block(num_experts, 2, True)
    ranks = [_block(num_experts, 2, True, rank=r, tp=tp) for r in range(tp)]
    x = torch.randn(11, HIDDEN)
    partial = sum(b(x) for b in ranks)  # what the all-reduce adds up
    torch.testing.assert_close(partial, full(x), rtol=1e-5, atol=1e-5)


def test_rank_loads_only_its_experts(model_factory, monkeypatch):
    """3 experts over 2 ranks: rank 0 holds experts 0 and 1, rank 1 expert 2, equal to the checkpoint's; the router
    is whole on both."""
    model_dir = model_factory("mixtral", num_local_experts=3)
    model, full = load_as_rank(model_dir, monkeypatch, rank=1, tp=2)
    moe = model.model.layers[0].mlp
    assert list(moe.experts) == ["2"]
    p = "model.layers.0.block_sparse_moe"
    assert torch.equal(moe.gate.weight, full[f"{p}.gate.weight"])
    w1, w3, w2 = (full[f"{p}.experts.2.{n}.weight"] for n in ("w1", "w3", "w2"))
    assert torch.equal(moe.experts["2"].gate_up_proj.weight, torch.cat([w1, w3]))
    assert torch.equal(moe.experts["2"].down_proj.weight, w2)
    assert CPUDecoderLayers.build(model.model.layers) is None  # the one-call C++ layer refuses MoE layers
