"""Structured output with llguidance: JSON schemas, any JSON object, regular expressions, choices and Lark/GBNF
grammars become token masks.

Grammars compile on a few threads off the engine loop (``GrammarCompiler``), kept in an LRU cache keyed by the
constraint (one compiled matcher per distinct constraint, which every sequence that uses it deep-copies), so the
engine thread never waits for one: a request stays in the waiting queue until its grammar is ready while the others
go ahead (vLLM's WAITING_FOR_FSM). A grammar that fails to compile, or takes longer than the compile timeout, ends
only its own request, which holds no KV blocks yet; beyond a bound on queued compiles, a request is refused.

Each step the scheduler asks for one batched bitmask, a row per sampling row (drafts included: row j allows what
may follow the first j drafts), and matchers advance only on the tokens a sequence keeps, so nothing needs rolling
back when speculation is rejected.

When the model runs in the engine's process the bitmask is filled on a thread while the forward pass runs (as
vLLM overlaps it with the GPU): llguidance releases the GIL, and the runner waits for it only before sampling.
Filling it before the step measured slower than overlapping it, even on CPUs whose OpenMP threads leave no core free.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from pagedserve.common.config import StructuredOutputsConfig
from pagedserve.common.sampling_params import StructuredOutputsParams
from pagedserve.scheduler.grammar_compiler import Compile, GrammarCompiler

_ANY_JSON_OBJECT = '{"type": "object"}'
# Whitespace between JSON tokens, bounded: a small model sampled at temperature 1 otherwise can spend its whole budget
# on whitespace that the grammar allows. Enough for pretty-printing a few levels deep. A schema asks otherwise with
# its own "x-guidance" options (llguidance's whitespace_pattern / whitespace_flexible).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"


def grammar_spec(so: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (cheap: the compiling is done by the matcher)."""
    if so.json is not None or so.json_object:
        schema = _ANY_JSON_OBJECT if so.json is None else so.json if isinstance(so.json, str) else json.dumps(so.json)
        defaults = {"whitespace_flexible": False} if so.disable_any_whitespace else \
            {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
    if so.regex is not None:
        return llguidance.grammar_from("regex", so.regex)
    if so.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(so.choice))
    return llguidance.grammar_from("grammar", so.grammar)


def grammar_error(so: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer) -> str | None:
    """Why a constraint cannot be compiled, naming its kind; None when it can."""
    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_spec(so), tokenizer)
    except (ValueError, TypeError) as e:
        return f"structured_outputs.{so.kind}: {e}"
    return f"structured_outputs.{so.kind}: {'; '.join(messages).strip()}" if is_error else None


class StructuredOutputManager:
    """``tokenizer_factory`` builds the llguidance tokenizer (the model's vocabulary and EOS ids); it is called once,
    on a compile thread, when the first constrained request arrives."""

    def __init__(self, tokenizer_factory: Callable[[], llguidance.LLTokenizer], vocab_size: int,
                 config: StructuredOutputsConfig | None = None) -> None:
        config = config if config is not None else StructuredOutputsConfig()
        self._tokenizer_factory = tokenizer_factory
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self.vocab_size = vocab_size
        self.compiler: GrammarCompiler[llguidance.LLMatcher] = GrammarCompiler(
            self._compile, cache_size=config.cache_size, max_pending=config.max_pending_compiles,
            timeout=config.compile_timeout, setup=self._build_tokenizer)
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-bitmask")
        self._executor: llguidance.LLExecutor | None = None
        self._pending: dict[str, tuple[Compile[llguidance.LLMatcher], str]] = {}  # request id -> its grammar, kind
        self._matchers: dict[int, llguidance.LLMatcher] = {}  # seq id -> its matcher
        self.compile_seconds: list[float] = []  # compile times not yet observed by the metrics
        self.num_constrained_requests = 0

    def _build_tokenizer(self) -> None:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._tokenizer_factory()

    def _compile(self, so: StructuredOutputsParams) -> llguidance.LLMatcher:
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(self._tokenizer, grammar_spec(so))
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
        self.compile_seconds.append(time.perf_counter() - start)
        return matcher

    def take_compile_seconds(self) -> list[float]:
        """Compile times since the last call (appended on the compile threads; list.pop is atomic)."""
        return [self.compile_seconds.pop(0) for _ in range(len(self.compile_seconds))]

    def add(self, request_id: str, so: StructuredOutputsParams) -> None:
        """Start compiling a request's grammar (or reuse the cached compile); raises ``OverloadedError`` when too
        many compiles are queued already."""
        compile_, _ = self.compiler.submit(so)
        self._pending[request_id] = compile_, so.kind
        self.num_constrained_requests += 1

    def ready(self, request_id: str) -> bool:
        """Whether the request may be scheduled: unconstrained, or its grammar compiled in time."""
        pending = self._pending.get(request_id)
        return pending is None or self.compiler.ready(pending[0])

    def failures(self) -> list[tuple[str, str]]:
        """(request id, why) of the waiting requests whose grammar failed to compile or timed out."""
        failed = []
        for request_id, (compile_, kind) in self._pending.items():
            why = self.compiler.failure(compile_)
            if why is not None:
                failed.append((request_id, f"structured_outputs.{kind}: {why}"))
        return failed

    def wait_for_compile(self, timeout: float) -> None:
        """Until a waiting request's grammar compile ends, at most ``timeout`` seconds; at once when none is
        compiling."""
        compiling = [c.future for c, _ in self._pending.values() if not c.future.done()]
        if compiling:
            wait(compiling, timeout, return_when=FIRST_COMPLETED)

    def start(self, request_id: str, seqs: list[tuple[int, list[int]]]) -> None:
        """Matchers for a request's sequences, (seq id, output tokens so far) each, once its grammar is ready."""
        prototype = self._pending.pop(request_id)[0].future.result()
        for seq_id, output in seqs:
            matcher = prototype.deep_copy()
            if output:  # a request resumed from another engine: replay what it generated
                matcher.consume_tokens(output)
            self._matchers[seq_id] = matcher

    def fork(self, parent: int, child: int) -> None:
        if parent in self._matchers:
            self._matchers[child] = self._matchers[parent].deep_copy()

    def constrained(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def accept(self, seq_id: int, token: int) -> bool:
        """Advance on a token the sequence keeps; True once the grammar is complete (nothing may follow)."""
        matcher = self._matchers[seq_id]
        matcher.consume_token(token)
        return matcher.is_stopped()

    def error(self, seq_id: int) -> str | None:
        """Why the sequence's matcher failed (llguidance stops a matcher it cannot go on with), else None."""
        matcher = self._matchers.get(seq_id)
        return matcher.get_error() if matcher is not None and matcher.is_error() else None

    def free(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def abandon(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def bitmask(self, rows: list[tuple[int, list[int]]], overlap: bool = False
                ) -> tuple[np.ndarray | Future[np.ndarray], dict[int, int]]:
        """One bitmask for this step's constrained sampling rows: per (seq id, drafts), 1 + len(drafts) rows (row
        j: what may follow the first j drafts); and each sequence's first row. With ``overlap`` the bitmask is a
        Future, filled on a thread (the matchers must not advance before it is done)."""
        first: dict[int, int] = {}
        plain, drafting = [], []  # llguidance's draft variant refuses empty drafts
        total = 0
        for seq_id, drafts in rows:
            first[seq_id] = total
            if drafts:
                drafting.append((self._matchers[seq_id], total, list(drafts)))
            else:
                plain.append((self._matchers[seq_id], total))
            total += 1 + len(drafts)
        if overlap:
            return self._fill_pool.submit(self._fill, total, plain, drafting), first
        return self._fill(total, plain, drafting), first

    def _fill(self, total: int, plain: list, drafting: list) -> np.ndarray:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        mask = llg_numpy.allocate_token_bitmask(total, self.vocab_size)
        if plain:
            llg_numpy.fill_next_token_bitmask_par(self._executor, plain, mask)
        if drafting:
            llg_numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafting, mask)
        return mask

    def shutdown(self) -> None:
        self.compiler.shutdown()
        self._fill_pool.shutdown(wait=True)
