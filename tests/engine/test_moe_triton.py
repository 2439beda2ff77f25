"""The Triton MoE kernels (kernels/triton/moe.py) against torch_ref.fused_moe (compiled on CUDA, interpreted on CPU),
over routings that stress the grouping: every token to one expert, experts with no tokens, one token, top-k = every
expert, odd widths, choices on another rank's experts, int8 experts; and MoE models on the Triton backend generating
what the torch backend does."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.kernels import torch_ref
from pagedserve.kernels.triton import moe
from pagedserve.tests.utils import assert_all_blocks_free, random_prompts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=4e-3, rtol=4e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _experts(n: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = [(torch.randn(2 * inter, hidden, generator=g) * hidden ** -0.5).to(DEVICE, dtype) for _ in range(n)]
    w2 = [(torch.randn(hidden, inter, generator=g) * inter ** -0.5).to(DEVICE, dtype) for _ in range(n)]
    return w13, w2


def _weights(ids: torch.Tensor, seed: int) -> torch.Tensor:
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) + 0.05
    return (w / w.sum(-1, keepdim=True)).to(DEVICE)


def _check(x, w13, w2, ids, weights, start=0, dtype=torch.float32):
    ids = ids.to(DEVICE)
    expected = torch_ref.fused_moe(x, w13, w2, ids, weights, start)
    got = moe.fused_moe(x, ids, weights, moe.stack_experts(w13, w2, start))
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden, inter", [(32, 48), (40, 37), (17, 9)])
def test_random_routings_equal_the_spec(dtype, hidden, inter):
    w13, w2 = _experts(6, hidden, inter, dtype, seed=hidden)
    for tokens, k in ((1, 2), (7, 3), (40, 2), (5, 6)):  # k = 6: every expert for every token
        x = torch.randn(tokens, hidden).to(DEVICE, dtype)
        ids = torch.stack([torch.randperm(6)[:k] for _ in range(tokens)])
        _check(x, w13, w2, ids, _weights(ids, tokens), dtype=dtype)


def test_every_token_to_one_expert_and_experts_with_none():
    w13, w2 = _experts(8, 32, 40, torch.float32, seed=1)
    x = torch.randn(70, 32).to(DEVICE)  # 70 rows on one expert: blocks of 64 and a remainder
    ids = torch.full((70, 1), 3)
    _check(x, w13, w2, ids, torch.ones(70, 1, device=DEVICE))
    ids = torch.stack([torch.tensor([3, 5])] * 70)
    _check(x, w13, w2, ids, _weights(ids, 2))


def test_choices_on_other_ranks_add_nothing():
    """This rank holds experts 4..6 of 10: tokens with none of them get zeros, the others only their local share."""
    w13, w2 = _experts(3, 32, 24, torch.float32, seed=2)
    ids = torch.tensor([[0, 1], [4, 9], [6, 5], [2, 3], [8, 4]])
    x = torch.randn(5, 32).to(DEVICE)
    _check(x, w13, w2, ids, _weights(ids, 3), start=4)
    got = moe.fused_moe(x, ids.to(DEVICE), _weights(ids, 3), moe.stack_experts(w13, w2, 4))
    assert got[0].abs().max() == 0 and got[3].abs().max() == 0


def test_align_by_expert_groups_pairs_in_padded_blocks():
    ids = torch.tensor([[2, 0], [2, 1], [5, 2]])  # expert 5 belongs to another rank
    blocks = moe.align_by_expert(ids, expert_start=0, num_experts=3, block_m=2)
    pairs = blocks.sorted_pairs.view(-1, 2)
    used = blocks.block_expert >= 0
    assert blocks.block_expert[used].tolist() == [0, 1, 2, 2]
    assert pairs[used].tolist() == [[1, 6], [3, 6], [0, 2], [5, 6]]  # 6: a padding row (num_pairs)
    assert (blocks.block_expert[~used] == -1).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_experts_equal_the_spec(dtype):
    w13, w2 = _experts(4, 40, 24, torch.float32, seed=5)
    q13, s13 = zip(*[torch_ref.quantize_int8(w) for w in w13])
    q2, s2 = zip(*[torch_ref.quantize_int8(w) for w in w2])
    for tokens in (1, 9, 33):
        x = torch.randn(tokens, 40).to(DEVICE, dtype)
        ids = torch.stack([torch.randperm(4)[:2] for _ in range(tokens)]).to(DEVICE)
        weights = _weights(ids, tokens)
        expected = torch_ref.fused_moe(x, list(q13), list(q2), ids, weights, 0, list(s13), list(s2))
        got = moe.fused_moe(x, ids, weights, moe.stack_experts(list(q13), list(q2), 0, list(s13), list(s2)))
        torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])


@pytest.mark.parametrize("arch, quantization", [("mixtral", None), ("qwen3_moe", None), ("mixtral", "int8")])
def test_moe_models_on_triton_generate_what_torch_does(arch, quantization, model_factory):
    model_dir = model_factory(arch)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, seed=9, min_len=5, max_len=30)]
    params = SamplingParams(temperature=0, max_tokens=5)
    kwargs = dict(dtype="float32", max_num_seqs=3, max_num_batched_tokens=32, enable_prefix_caching=False,
                  quantization=quantization)
    ref = LLM(model_dir, attention_backend="torch", **kwargs).generate(prompts, params, use_tqdm=False)
    tri = LLM(model_dir, attention_backend="triton", **kwargs)
    model = tri.llm_engine.core.executor.worker.model_runner.model
    blocks = [m for m in model.modules() if hasattr(m, "expert_ids")]
    assert blocks and all(isinstance(b.moe_panels, moe.StackedExperts) and len(b.experts) == 0 for b in blocks)
    got = tri.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert_all_blocks_free(tri)
