"""Streaming text never contains broken UTF-8, and equals a one-shot decode at the end."""
from __future__ import annotations

import itertools
import random

from transformers import AutoTokenizer

from pagedserve import EngineArgs, LLMEngine, SamplingParams
from pagedserve.engine.detokenizer import IncrementalDetokenizer, rust_backend

TEXT = "café naïve — “quotes” 🚀🔥 中文字符 ümlauts end"


def test_incremental_deltas_are_clean(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt = tok.encode("Hello:")
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT) / 3, "tokenizer should split multi-byte characters"
    det = IncrementalDetokenizer(tok, prompt, SamplingParams())
    deltas = []
    for t in ids:
        det.add_tokens([t])
        d = det.take_delta(finished=False)
        assert "\ufffd" not in d
        deltas.append(d)
    det.flush()
    deltas.append(det.take_delta(finished=True))
    assert "".join(deltas) == TEXT == tok.decode(ids)
    assert sum(1 for d in deltas if d) > 10


def test_rust_backend_decodes_as_the_tokenizer(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    backend = rust_backend(tok)
    assert backend is not None, "a fast tokenizer without clean-up should take the direct path"
    rng = random.Random(0)
    for _ in range(200):  # random ids, special tokens included: broken UTF-8 and skipped specials decode alike
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert backend.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    tok.clean_up_tokenization_spaces = True  # transformers post-processes then: keep its decode
    assert rust_backend(tok) is None


def test_stop_string_is_never_streamed_partially(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok.encode(TEXT)
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["中文"]))
    streamed = ""
    for t in ids:
        stopped = det.add_tokens([t])
        streamed += det.take_delta(finished=stopped)
        if stopped:
            break
    assert streamed == TEXT[: TEXT.index("中文")]
    assert "中" not in streamed and det.stop_reason == "中文"


def test_engine_streaming_outputs_grow_monotonically(llama_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=llama_dir))
    engine.add_request("s", "café 🚀 naïve", SamplingParams(temperature=1.0, seed=0, max_tokens=30), stream=True)
    texts, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.outputs[0].text)
            final = out
    assert len(texts) == 30 and final.finished
    for a, b in itertools.pairwise(texts):
        assert b.startswith(a)
    tok = engine.tokenizer
    assert final.outputs[0].text == tok.decode(final.outputs[0].token_ids, skip_special_tokens=True)


def test_stream_interval_batches_tokens_and_keeps_the_text(llama_dir):
    """vLLM's --stream-interval: the first token at once, then an output per `interval` new tokens, and the end;
    a request's stream_interval raises the engine's, never lowers it. The streamed text is the same."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=llama_dir, stream_interval=4))
    cases = {"engine": None, "raised": 7, "clamped": 2}
    for rid, interval in cases.items():
        engine.add_request(rid, "café 🚀 naïve", SamplingParams(temperature=0.7, seed=1, max_tokens=30,
                                                               ignore_eos=True, stream_interval=interval), stream=True)
    counts: dict[str, list[int]] = {rid: [] for rid in cases}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id].append(len(out.outputs[0].token_ids))
            finals[out.request_id] = out
    for rid, k in (("engine", 4), ("raised", 7), ("clamped", 4)):
        n = counts[rid]
        assert n[0] == 1 and n[-1] == 30 and finals[rid].finished, n
        assert [b - a for a, b in itertools.pairwise(n)][:-1] == [k] * ((29 - 1) // k), n
        assert len(n) == 1 + -(-29 // k)
    full = LLMEngine.from_engine_args(EngineArgs(model=llama_dir))
    full.add_request("x", "café 🚀 naïve", SamplingParams(temperature=0.7, seed=1, max_tokens=30, ignore_eos=True))
    while full.has_unfinished_requests():
        for out in full.step():
            expected = out.outputs[0]
    for rid in cases:
        assert finals[rid].outputs[0].token_ids == expected.token_ids
        assert finals[rid].outputs[0].text == expected.text
