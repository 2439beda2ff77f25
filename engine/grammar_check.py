"""The intake's compile check of a structured-output constraint, bounded in time.

Checking a grammar costs as much as compiling it, seconds for some valid schemas, and the intake runs on the thread
that steps the offline engine or on a gateway's event loop. So the check runs on compile threads and the intake
waits for it only briefly: a grammar that does not compile is refused there, as a bad request, when its check ends
within ``INTAKE_WAIT_S`` (bad grammars fail fast); otherwise the engine, which compiles it anyway off its step loop
and under its compile timeout, ends the request if it fails. Verdicts are cached by constraint, so a repeated
constraint costs nothing here. A small constraint (at most ``SMALL_CHARS`` of text) is checked in place, as before:
it takes milliseconds, and a short bad regex or schema is then refused at intake however loaded the machine or busy
the check threads.
"""
from __future__ import annotations

from concurrent.futures import TimeoutError as FutureTimeout

import llguidance

from pagedserve.common.errors import OverloadedError
from pagedserve.common.sampling_params import StructuredOutputsParams
from pagedserve.scheduler.grammar_compiler import GrammarCompiler, constraint_key
from pagedserve.scheduler.structured_output import grammar_error

INTAKE_WAIT_S = 0.05
SMALL_CHARS = 4096
CACHE_SIZE = 256
MAX_PENDING = 16  # checks queued or running; beyond, the engine's compile alone decides


class GrammarCheck:
    def __init__(self, tokenizer: llguidance.LLTokenizer, wait: float = INTAKE_WAIT_S) -> None:
        self._tokenizer = tokenizer
        self.wait = wait
        self.compiler: GrammarCompiler[str | None] = GrammarCompiler(
            self._check, cache_size=CACHE_SIZE, max_pending=MAX_PENDING, name="grammar-check")

    def _check(self, so: StructuredOutputsParams) -> str | None:
        return grammar_error(so, self._tokenizer)

    def error(self, so: StructuredOutputsParams) -> str | None:
        """Why the constraint does not compile, naming its kind; None when it does or when that is not known yet
        (its check outlasted the wait: only the first request to send a constraint waits for its check)."""
        try:
            key = constraint_key(so)
        except (TypeError, ValueError) as e:  # a schema dict that is not JSON
            return f"structured_outputs.{so.kind}: {e}"
        if len(key[1]) <= SMALL_CHARS:
            return self._check(so)
        try:
            check, new = self.compiler.submit(so, key)
        except OverloadedError:
            return None
        try:
            return check.future.result(timeout=self.wait if new else 0)
        except FutureTimeout:
            return None
