"""Sampling parameters: seeds, filters, penalties, stops, min_tokens, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.tests.utils import EOS, VOCAB, assert_all_blocks_free, load_hf_reference, random_prompts


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir)


def _gen(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


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


def test_repetition_penalty_matches_hf(llama_dir, llm):
    prompt = random_prompts(1, seed=21)[0]
    out = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.5,
                                             ignore_eos=True))[0].outputs[0]
    hf = load_hf_reference(llama_dir)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=1.5,
                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == ref


def test_frequency_presence_penalties_greedy_reference(llama_dir, llm):
    prompt = random_prompts(1, seed=22)[0]
    params = SamplingParams(temperature=0, max_tokens=12, frequency_penalty=1.5, presence_penalty=0.7,
                            ignore_eos=True)
    out = _gen(llm, [prompt], params)[0].outputs[0]
    hf = load_hf_reference(llama_dir)
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
    hf = load_hf_reference(llama_dir)
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


def test_logprobs_beside_rows_that_do_not_ask(llm):
    """Only the rows that want logprobs get them computed: in a batch of requests without logprobs, a logprobs
    request and a best_of one (ranked by cumulative logprob) read as they do alone."""
    target, ranked = random_prompts(2, seed=31, min_len=10)
    lp_params = SamplingParams(temperature=0.8, seed=5, max_tokens=8, logprobs=2)
    best_params = SamplingParams(temperature=1.0, seed=6, max_tokens=6, n=1, best_of=3)
    alone = _gen(llm, [target], lp_params)[0].outputs[0]
    best_alone = _gen(llm, [ranked], best_params)[0].outputs[0]
    others = random_prompts(12, seed=32)
    params = [SamplingParams(temperature=t, seed=7, max_tokens=10) for t in [0.0, 0.7] * 6]
    outs = llm.generate([{"prompt_token_ids": p} for p in [*others[:6], target, ranked, *others[6:]]],
                        [*params[:6], lp_params, best_params, *params[6:]], use_tqdm=False)
    got, best = outs[6].outputs[0], outs[7].outputs[0]
    assert got.token_ids == alone.token_ids and best.token_ids == best_alone.token_ids
    for a, b, t in zip(got.logprobs, alone.logprobs, alone.token_ids):
        assert set(a) == set(b) and abs(a[t].logprob - b[t].logprob) < 1e-5 and a[t].rank == b[t].rank
    assert math.isclose(got.cumulative_logprob, alone.cumulative_logprob, abs_tol=1e-4)
    assert math.isclose(best.cumulative_logprob, best_alone.cumulative_logprob, abs_tol=1e-4)
    assert all(o.outputs[0].logprobs is None and o.outputs[0].cumulative_logprob is None
               for i, o in enumerate(outs) if i not in (6, 7))


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
