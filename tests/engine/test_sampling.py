"""Sampling parameters: seeds, filters, penalties, stops, min_tokens, logprobs."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.tests.utils import EOS, VOCAB, assert_all_blocks_free, random_prompts
from pagedserve.worker.sampler import SamplingMetadata, apply_penalties, hashed_uniform, sample


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir)


def _gen(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _md(n: int, **kw) -> SamplingMetadata:
    base = dict(temperature=torch.ones(n), all_greedy=False, top_k=None, top_p=None, min_p=None,
                seeds=torch.arange(n, dtype=torch.long) * 7919 + 13, counters=torch.zeros(n, dtype=torch.long))
    base.update(kw)
    return SamplingMetadata(**base)


def test_seeded_sampling_is_batch_invariant(llm):
    target = random_prompts(1, seed=11)[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20)
    alone = _gen(llm, [target], params)[0].outputs[0]
    others = random_prompts(30, seed=12)
    mixed = [SamplingParams(temperature=t, seed=s, max_tokens=m, min_p=0.05 * (i % 2))
             for i, (t, s, m) in enumerate(zip([0, 0.5, 1.3] * 10, [None, 7] * 15, [5, 30, 12] * 10))]
    outs = llm.generate([{"prompt_token_ids": p} for p in others[:15] + [target] + others[15:]],
                        mixed[:15] + [params] + mixed[15:], use_tqdm=False)
    assert outs[15].outputs[0].token_ids == alone.token_ids
    assert outs[15].outputs[0].text == alone.text
    different = _gen(llm, [target], SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=20))
    assert different[0].outputs[0].token_ids != alone.token_ids
    assert_all_blocks_free(llm)


def test_seeded_sampling_survives_preemption(llama_dir, llm):
    prompts = random_prompts(10, seed=13, max_len=60)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24) for i in range(10)]
    free = [o.outputs[0].token_ids for o in _gen(llm, prompts, params)]
    tight = LLM(llama_dir, num_gpu_blocks_override=10)
    assert [o.outputs[0].token_ids for o in _gen(tight, prompts, params)] == free
    assert tight.llm_engine.core.scheduler.stats.num_preemptions["recompute"] > 0


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
    min_p = sample(logits, _md(n, min_p=torch.full((n,), 0.3))).token_ids  # >= 0.15 kept
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


def test_repetition_penalty_matches_hf(llama_dir, llm):
    prompt = random_prompts(1, seed=21)[0]
    out = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.5,
                                             ignore_eos=True))[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=1.5,
                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == ref


def test_frequency_presence_penalties_greedy_reference(llama_dir, llm):
    prompt = random_prompts(1, seed=22)[0]
    params = SamplingParams(temperature=0, max_tokens=12, frequency_penalty=1.5, presence_penalty=0.7,
                            ignore_eos=True)
    out = _gen(llm, [prompt], params)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    seq, gen = list(prompt), []
    with torch.no_grad():
        for _ in range(12):
            logits = hf(torch.tensor([seq])).logits[0, -1].clone()
            for tok in set(gen):
                logits[tok] -= 1.5 * gen.count(tok) + 0.7
            nxt = int(logits.argmax())
            seq.append(nxt)
            gen.append(nxt)
    assert out.token_ids == gen


def test_stop_token_ids_and_min_tokens(llm):
    prompt = random_prompts(1, seed=23)[0]
    base = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop_tok = base.token_ids[2]
    first = base.token_ids.index(stop_tok)
    out = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                             stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    held = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                              stop_token_ids=[stop_tok], min_tokens=8))[0].outputs[0]
    assert len(held.token_ids) >= 8 and stop_tok not in held.token_ids[:8]
    assert held.finish_reason == "length" or held.token_ids[-1] == stop_tok


def test_eos_and_ignore_eos(llm):
    prompts = random_prompts(12, seed=24)
    params = SamplingParams(temperature=0, max_tokens=30)
    stopped = [o.outputs[0] for o in _gen(llm, prompts, params)]
    ended = [o for o in stopped if o.finish_reason == "stop"]
    for o in ended:
        assert o.token_ids[-1] == EOS and o.stop_reason is None
    forced = [o.outputs[0] for o in _gen(llm, prompts, SamplingParams(temperature=0, max_tokens=30,
                                                                       ignore_eos=True))]
    assert all(len(o.token_ids) == 30 and o.finish_reason == "length" for o in forced)
    eos_banned = _gen(llm, prompts, SamplingParams(temperature=0, max_tokens=30, min_tokens=30))
    assert all(EOS not in o.outputs[0].token_ids for o in eos_banned)


def test_greedy_rows_beside_a_min_tokens_row(llm):
    """All-greedy steps skip the per-row sampling settings only when no row has one: a row whose stop token is
    banned until min_tokens, sampled in the same steps as a plain greedy row, still gets it banned."""
    prompts = random_prompts(2, seed=23)
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in _gen(llm, prompts, plain)]
    stop_tok = base[1][2]
    held = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_tok], min_tokens=8)
    alone = _gen(llm, [prompts[1]], held)[0].outputs[0].token_ids
    both = [o.outputs[0].token_ids for o in _gen(llm, prompts, [plain, held])]
    assert both == [base[0], alone]
    assert len(alone) >= 8 and stop_tok not in alone[:8]


def test_stop_string_across_token_boundary(llm):
    tok = llm.get_tokenizer()
    prompt = tok.encode("def main(argv):\n    return")
    base = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    # A stop string from the last char of token k, through token k+1, to the first char of token k+2.
    pieces = [tok.decode([t]) for t in base.token_ids]
    clean = [bool(p) and "\ufffd" not in p for p in pieces]
    k = next(i for i in range(1, len(pieces) - 2) if all(clean[i: i + 3]))
    stop = pieces[k][-1] + pieces[k + 1] + pieces[k + 2][0]
    idx = base.text.find(stop)
    assert idx != -1
    out = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
    c = out[0].outputs[0]
    assert c.text == base.text[:idx] and c.finish_reason == "stop" and c.stop_reason == stop
    kept = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop,
                                              include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == base.text[: idx + len(stop)]
    assert_all_blocks_free(llm)


def test_logprobs_topk_and_prompt_logprobs(llama_dir, llm):
    prompt = random_prompts(1, seed=25, min_len=20)[0]
    out = _gen(llm, [prompt], SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=3,
                                             prompt_logprobs=2))[0]
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    full = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
        top2 = ref[pos - 1].topk(2).indices.tolist()
        assert set(top2) <= set(entry)
    for j, (tok, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        row = ref[len(prompt) + j - 1]
        assert abs(lp[tok].logprob - row[tok].item()) < 1e-4
        assert lp[tok].rank == int((row > row[tok]).sum()) + 1
        assert set(row.topk(3).indices.tolist()) <= set(lp)
    total = sum(lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids))
    assert math.isclose(out.outputs[0].cumulative_logprob, total, abs_tol=1e-4)


def test_prompt_logprobs_with_chunked_prefill(llama_dir, llm):
    prompt = random_prompts(1, seed=26, min_len=40, max_len=50)[0]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    whole = _gen(llm, [prompt], params)[0].prompt_logprobs
    chunked = _gen(LLM(llama_dir, max_num_batched_tokens=9), [prompt], params)[0].prompt_logprobs
    assert len(whole) == len(chunked) == len(prompt)
    for a, b in zip(whole[1:], chunked[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[k].logprob - b[k].logprob) < 1e-5 for k in a)


def test_vocab_outside_tokens_never_sampled(llm):
    outs = _gen(llm, random_prompts(4, seed=27), SamplingParams(temperature=1.5, max_tokens=20, seed=5))
    assert all(0 <= t < VOCAB for o in outs for t in o.outputs[0].token_ids)


def test_prompt_logprobs_bypass_a_warm_prefix_cache(llama_dir):
    llm = LLM(llama_dir, seed=0, enable_prefix_caching=True)
    prompt = {"prompt_token_ids": random_prompts(1, seed=5, min_len=40, max_len=40)[0]}
    llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)  # fills the cache
    out = llm.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == 40 and all(e is not None for e in out.prompt_logprobs[1:])


def test_token_bitmask_bits_and_rows():
    """Bit t of int32 word t // 32 allows token t (llguidance's layout); unlisted rows are untouched; tokens past
    the mask's width are not allowed, bits past the vocabulary are ignored. The torch reference, the C++ kernel and
    the sampler's choice between them all follow that definition, and none writes into its input."""
    import numpy as np

    from pagedserve.kernels import cpu_extension, cpu_fused, torch_ref
    from pagedserve.worker.sampler import apply_token_bitmask

    impls = [torch_ref.apply_token_bitmask, apply_token_bitmask]
    if cpu_extension.load() is not None:
        impls.append(cpu_fused.apply_token_bitmask)
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
