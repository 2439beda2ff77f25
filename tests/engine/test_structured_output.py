"""Structured output end to end on a tiny random model with a byte-level BPE tokenizer: 50 sampled requests
(temperature 1) per kind all satisfy their constraint, unconstrained requests sharing the batch are unaffected,
and the constraint holds with n > 1, chunked prefill, preemption and prefix caching."""
from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from pagedserve import LLM, SamplingParams
from pagedserve.common.config import default_model_dir
from pagedserve.common.errors import InvalidRequestError
from pagedserve.common.sampling_params import StructuredOutputsParams
from pagedserve.scheduler.structured_output import grammar_spec
from pagedserve.tests.utils import assert_all_blocks_free, random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "name", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"
CHOICES = ["red", "green", "blue", "naïve"]
GRAMMAR = 'start: item ("," item)? ("," item)?\nitem: "cat" | "dog" | NUM\nNUM: /[0-9]{1,3}/'
GRAMMAR_RE = r"(cat|dog|[0-9]{1,3})(,(cat|dog|[0-9]{1,3})){0,2}"
N = 50


def _check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(GRAMMAR_RE, text), text


CONSTRAINTS = {
    # Compact JSON: a random model otherwise spends its tokens on the whitespace JSON allows.
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "json_object": StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(llama_dir, seed=0) as llm:
        yield llm


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_sampled_outputs_satisfy_the_constraint(llm, kind):
    so = CONSTRAINTS[kind]
    # json_object is any object, keys of any length: a random model often writes one until max_tokens; those
    # must still be an object's start, and those that end must parse.
    max_tokens = 240 if kind == "json_object" else 120
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=so)
              for i in range(N)]
    outs = llm.generate(random_prompts(N, seed=7, max_len=12), params, use_tqdm=False)
    finished = [o.outputs[0] for o in outs]
    complete = [c for c in finished if c.finish_reason == "stop"]
    assert all(c.text.startswith("{") for c in finished if kind == "json_object")
    assert len(complete) >= (N // 5 if kind == "json_object" else N), \
        [(c.text, c.finish_reason) for c in finished if c.finish_reason != "stop"][:3]
    for c in complete:
        _check(kind, c.text)
    assert len({c.text for c in complete}) > (1 if kind == "choice" else len(complete) // 5)  # sampled, not fixed
    assert_all_blocks_free(llm)


def test_unconstrained_neighbours_unchanged_n_gt_1_and_fill_overlap(llm):
    prompts = random_prompts(6, seed=3)
    free = [SamplingParams(temperature=t, seed=11 + i, max_tokens=24) for i, t in enumerate([0, 0, 0.9, 0.9, 0, 1])]
    alone = llm.generate(prompts, free, use_tqdm=False)
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, n=3, structured_outputs=so)
                   for i, so in enumerate(CONSTRAINTS.values())]
    mixed = llm.generate(prompts + random_prompts(len(constrained), seed=4), free + constrained, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:6]] == [o.outputs[0].token_ids for o in alone]
    scheduler = llm.llm_engine.core.scheduler
    assert scheduler.overlap_grammar_bitmask  # in-process runner: filled during the forward pass
    scheduler.overlap_grammar_bitmask = False  # as for Ray workers: filled before the step is sent
    try:
        serial = llm.generate(prompts + random_prompts(len(constrained), seed=4), free + constrained, use_tqdm=False)
    finally:
        scheduler.overlap_grammar_bitmask = True
    assert [[c.token_ids for c in o.outputs] for o in serial] == [[c.token_ids for c in o.outputs] for o in mixed]
    for kind, out in zip(CONSTRAINTS, mixed[6:]):
        assert len(out.outputs) == 3
        for c in out.outputs:
            if c.finish_reason == "stop":
                _check(kind, c.text)
    assert_all_blocks_free(llm)


def test_bad_constraints_refused_before_anything_is_allocated(llm):
    for so, words in [(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nope"}}}),
                       "json"),
                      (StructuredOutputsParams(regex="(unclosed"), "regex"),
                      (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar")]:
        with pytest.raises(InvalidRequestError, match=words):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    assert_all_blocks_free(llm)


def test_constraint_holds_through_chunked_prefill_preemption_and_prefix_cache(llama_dir):
    # 24 KV blocks of 16 for 24 requests that need ~3 each: recompute and swap preemption both happen.
    args = dict(seed=0, num_gpu_blocks_override=24, max_num_batched_tokens=256, max_model_len=256,
                enable_chunked_prefill=True)
    shared = random_prompts(1, seed=9, min_len=40, max_len=40)[0]  # a common prefix for the prefix cache
    prompts = [shared + p for p in random_prompts(24, seed=5, max_len=8)]
    kinds = list(CONSTRAINTS)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, n=2 if i % 3 == 0 else 1,
                             structured_outputs=CONSTRAINTS[kinds[i % len(kinds)]]) for i in range(24)]
    with LLM(llama_dir, **args) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.llm_engine.core.get_stats().scheduler
        assert sum(stats.num_preemptions.values()) > 0
        assert stats.prefix_cache_hits > 0
        for i, out in enumerate(outs):
            for c in out.outputs:
                if c.finish_reason == "stop":
                    _check(kinds[i % len(kinds)], c.text)
        assert sum(c.finish_reason == "stop" for o in outs for c in o.outputs) >= 24
        assert_all_blocks_free(llm)



def test_json_whitespace_is_bounded_unless_the_schema_asks_otherwise():
    """Between JSON tokens at most JSON_WHITESPACE's 16 whitespace characters by default, none with
    disable_any_whitespace, and what the schema's own x-guidance options say when it has them."""
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    ll_tok = llguidance.hf.from_tokenizer(tok)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def accepts(so: StructuredOutputsParams, text: str) -> bool:
        matcher = llguidance.LLMatcher(ll_tok, grammar_spec(so))
        return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and not matcher.is_error()

    pretty = '{\n    "a": 1\n}'
    assert accepts(StructuredOutputsParams(json=schema), pretty)
    assert accepts(StructuredOutputsParams(json=schema), "{" + " " * 16 + '"a": 1}')
    assert not accepts(StructuredOutputsParams(json=schema), "{" + " " * 17 + '"a": 1}')
    assert not accepts(StructuredOutputsParams(json=schema, disable_any_whitespace=True), '{ "a": 1}')
    free = {**schema, "x-guidance": {"whitespace_pattern": "[ ]*"}}
    assert accepts(StructuredOutputsParams(json=free), "{" + " " * 40 + '"a": 1}')
