"""The sampler alone, on hand-made logits: seeded draws, top-k/top-p/min-p filters, penalties, token bitmasks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.kernels import torch_ref
from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.kernels.cpu import fused as cpu_fused
from pagedserve.tests.utils import cpu_backend
from pagedserve.worker.sampler import SamplingMetadata, apply_penalties, hashed_uniform, sample

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # the sampler as a CPU worker runs it


def _md(n: int, **kw) -> SamplingMetadata:
    base = dict(temperature=torch.ones(n), all_greedy=False, top_k=None, top_p=None, min_p=None,
                seeds=torch.arange(n, dtype=torch.long) * 7919 + 13, counters=torch.zeros(n, dtype=torch.long))
    base.update(kw)
    return SamplingMetadata(**base)


def test_hashed_uniform_is_uniform():
    u = hashed_uniform(torch.arange(20000, dtype=torch.long) * 31 + 5, torch.full((20000,), 3))
    assert 0 < u.min() and u.max() < 1
    hist = torch.histc(u.float(), bins=10, min=0, max=1)
    assert (hist - 2000).abs().max() < 200


def test_sampling_follows_distribution_and_filters():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    n = 20000
    logits = probs.log().expand(n, 4).clone()
    counts = torch.bincount(sample(logits, _md(n)).token_ids, minlength=4).float() / n
    assert torch.allclose(counts, probs, atol=0.015)
    top_k = sample(logits, _md(n, top_k=torch.full((n,), 2))).token_ids
    assert set(top_k.tolist()) == {0, 1} and abs((top_k == 0).float().mean() - 2 / 3) < 0.02
    top_p = sample(logits, _md(n, top_p=torch.full((n,), 0.7))).token_ids  # keeps 0.5 + 0.25
    assert set(top_p.tolist()) == {0, 1}
    # >= 0.145 kept (not min_p 0.3: 0.15 would sit exactly on the threshold, kept or not by exp's last bit)
    min_p = sample(logits, _md(n, min_p=torch.full((n,), 0.29))).token_ids
    assert set(min_p.tolist()) == {0, 1, 2}
    cold = sample(logits, _md(n, temperature=torch.full((n,), 0.05))).token_ids
    assert (cold == 0).float().mean() > 0.99


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    md = _md(2, repetition_penalty=torch.tensor([2.0, 1.0]), presence_penalty=torch.tensor([0.5, 0.3]),
             frequency_penalty=torch.tensor([0.25, 0.1]),
             prompt_tokens=torch.tensor([[0, 1], [4, -1]]), output_tokens=torch.tensor([[3, 3, 1], [2, -1, -1]]))
    got = apply_penalties(logits.clone(), md)
    expected = logits.clone().tolist()
    for row, (rep, pres, freq, prompt, output) in enumerate(
            [(2.0, 0.5, 0.25, [0, 1], [3, 3, 1]), (1.0, 0.3, 0.1, [4], [2])]):
        for tok in range(5):
            v = expected[row][tok]
            if tok in prompt or tok in output:
                v = v / rep if v > 0 else v * rep
            c = output.count(tok)
            v -= freq * c + (pres if c else 0.0)
            expected[row][tok] = v
    assert torch.allclose(got, torch.tensor(expected))


def test_token_bitmask_bits_and_rows():
    """Bit t of int32 word t // 32 allows token t (llguidance's layout); unlisted rows are untouched; tokens past
    the mask's width are not allowed, bits past the vocabulary are ignored. The torch reference, the C++ kernel and
    the CPU backend's choice between them all follow that definition, and none writes into its input."""
    impls = [torch_ref.apply_token_bitmask]
    if cpu_extension.available():
        impls += [cpu_fused.apply_token_bitmask, cpu_backend().apply_token_bitmask]
    vocab = 331
    rng = np.random.default_rng(0)
    for words in (10, 12):  # 320 bits < 331 < 384
        mask = rng.integers(-2**31, 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
        mask[1, 2] = -1  # a word allowing all 32 tokens
        logits = torch.randn(5, vocab)
        before = logits.clone()
        rows = torch.tensor([0, 2, 4])
        for impl in impls:
            out = impl(logits, rows, torch.from_numpy(mask))
            assert torch.equal(logits, before)
            for i, r in enumerate(rows.tolist()):
                want = [t < 32 * words and (int(mask[i, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)]
                assert (out[r] != float("-inf")).tolist() == want
                assert torch.equal(out[r][torch.tensor(want)], logits[r][torch.tensor(want)])
            assert torch.equal(out[[1, 3]], logits[[1, 3]])
            assert torch.equal(impl(logits[rows], torch.arange(3), torch.from_numpy(mask)), out[rows])



@pytest.mark.skipif(not cpu_extension.available(), reason="no C++ compiler")
def test_sampling_kernel_matches_the_torch_reference():
    """The C++ draw (cpu_fused.sample) against torch_ref.sample_rows on the same uniforms: the same tokens, row
    settings mixed (greedy rows, min-p, top-k, top-p and their combinations), a vocabulary that is not a multiple of
    16, and banned (-inf) tokens never drawn. Their softmaxes differ in the last bits, so a draw landing within that
    of a boundary may differ: at most one in a hundred here."""
    g = torch.Generator().manual_seed(0)
    B, V = 240, 1003
    logits = torch.randn(B, V, generator=g) * 2.5
    logits[:, 7] = float("-inf")  # banned everywhere
    temperature = torch.rand(B, generator=g) * 1.5 + 0.2
    temperature[::8] = 0.0
    u = hashed_uniform(torch.arange(B, dtype=torch.long) * 977 + 3, torch.arange(B, dtype=torch.long))
    greedy = logits.argmax(dim=1)
    settings = {
        "temperature only": (None, None, None),
        "top_k": (torch.randint(1, 60, (B,), generator=g), None, None),
        "top_p": (None, torch.rand(B, generator=g) * 0.9 + 0.05, None),
        "min_p": (None, None, torch.rand(B, generator=g) * 0.3),
        "all three": (torch.randint(1, 400, (B,), generator=g), torch.rand(B, generator=g) * 0.9 + 0.05,
                      torch.rand(B, generator=g) * 0.1),
        "unused values": (torch.full((B,), V), torch.ones(B), torch.zeros(B)),
    }
    for name, (top_k, top_p, min_p) in settings.items():
        want = torch_ref.sample_rows(logits, temperature, top_k, top_p, min_p, u, greedy)
        got = cpu_fused.sample(logits, temperature, top_k, top_p, min_p, u, greedy)
        assert (got == want).float().mean() >= 0.99, name
        assert torch.equal(got[::8], greedy[::8]) and not (got == 7).any(), name


@pytest.mark.skipif(not cpu_extension.available(), reason="no C++ compiler")
def test_sampling_kernel_draws_only_what_the_filters_keep():
    """One row drawn 4000 times (uniforms spread over (0, 1)): top-k keeps exactly the k most probable tokens, top-p
    the most probable ones up to its mass, min-p those at or above min_p x the top probability, each drawn at
    about its renormalized probability."""
    n = 4000
    probs = torch.tensor([0.05, 0.3, 0.02, 0.2, 0.13, 0.1, 0.2])  # two tied at 0.2: token 3 comes before 6
    logits = probs.log().expand(n, 7).contiguous()
    u = (torch.arange(n, dtype=torch.double) + 0.5) / n
    temp, greedy = torch.ones(n), torch.zeros(n, dtype=torch.long)

    def draws(top_k=None, top_p=None, min_p=None):
        full = {k: torch.full((n,), v) for k, v in (("top_p", top_p), ("min_p", min_p)) if v is not None}
        k = None if top_k is None else torch.full((n,), top_k, dtype=torch.long)
        out = cpu_fused.sample(logits, temp, k, full.get("top_p"), full.get("min_p"), u, greedy)
        return torch.bincount(out, minlength=7).float() / n

    def expect(kept):
        p = torch.zeros(7)
        p[kept] = probs[kept]
        return p / p.sum()

    assert torch.allclose(draws(), probs, atol=0.002)
    assert torch.allclose(draws(top_k=2), expect([1, 3]), atol=0.002)  # the tie at 0.2: token 3 (lower id)
    assert torch.allclose(draws(top_k=3), expect([1, 3, 6]), atol=0.002)
    assert torch.allclose(draws(top_p=0.49), expect([1, 3]), atol=0.002)  # 0.3 + 0.2 reach 0.49: no more
    assert torch.allclose(draws(top_p=0.51), expect([1, 3, 6]), atol=0.002)
    assert torch.allclose(draws(min_p=0.5), expect([1, 3, 6]), atol=0.002)  # >= 0.15
    assert torch.allclose(draws(top_k=4, top_p=0.9), expect([1, 3, 6, 4]), atol=0.002)


def test_logprobs_of_some_rows_equal_the_whole_batch_s():
    """With ``logprob_rows`` only those rows' logprobs are computed: the same values as over the whole batch, and
    0 / rank 1 / zeros in the rows that did not ask."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g) * 3
    md = _md(6, max_num_logprobs=4)
    full = sample(logits, md)
    rows = torch.tensor([1, 4])
    part = sample(logits, _md(6, max_num_logprobs=4, logprob_rows=rows))
    assert torch.equal(part.token_ids, full.token_ids)
    for name in ("logprobs", "top_ids", "top_logprobs", "ranks"):
        got, want = getattr(part, name), getattr(full, name)
        assert torch.equal(got[rows], want[rows]), name
        others = got[[0, 2, 3, 5]]
        assert torch.equal(others, torch.full_like(others, 1 if name == "ranks" else 0)), name
    assert (full.ranks[[0, 2, 3, 5]] >= 1).all() and full.logprobs.abs().sum() > 0
