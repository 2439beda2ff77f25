"""GrammarCompiler with a stand-in compile function (no llguidance): the LRU bound, the pending bound, the timeout
judged on a compile's own run time, and failures."""
from __future__ import annotations

import threading
import time

import pytest

from pagedserve.common.errors import OverloadedError
from pagedserve.common.sampling_params import StructuredOutputsParams
from pagedserve.scheduler.grammar_compiler import GrammarCompiler, constraint_key


def _regex(i: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=f"a{{{i}}}")


def _wait(c, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not c.future.done() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert c.future.done()


def test_constraint_key_is_exact():
    assert constraint_key(StructuredOutputsParams(json={"a": 1})) == ("json", '{"a": 1}', False)
    assert constraint_key(StructuredOutputsParams(json='{"a": 1}')) == ("json", '{"a": 1}', False)
    assert constraint_key(StructuredOutputsParams(json={"a": 1}, disable_any_whitespace=True)) != \
        constraint_key(StructuredOutputsParams(json={"a": 1}))
    assert constraint_key(StructuredOutputsParams(choice=["x", "y"])) == ("choice", '["x", "y"]', False)
    assert constraint_key(StructuredOutputsParams(json_object=True))[:2] == ("json_object", "")


def test_lru_keeps_the_bound_and_hits_on_a_repeat():
    compiler = GrammarCompiler(lambda so: so.regex, cache_size=2, max_pending=8, workers=1)
    try:
        a, new_a = compiler.submit(_regex(1))
        again, new_again = compiler.submit(_regex(1))
        assert new_a and not new_again and again is a
        _wait(a)
        assert a.future.result() == "a{1}" and compiler.ready(a)
        compiler.submit(_regex(2))
        compiler.submit(_regex(1))  # a hit: 1 becomes the most recently used
        compiler.submit(_regex(3))  # evicts 2, the least recently used
        assert compiler.num_compiles == 3
        assert not compiler.submit(_regex(1))[1]
        assert compiler.submit(_regex(2))[1]
        assert compiler.num_compiles == 4
    finally:
        compiler.shutdown()


def test_pending_bound_refuses_until_a_compile_ends():
    gate = threading.Event()
    compiler = GrammarCompiler(lambda so: gate.wait(10), cache_size=8, max_pending=2, workers=1)
    try:
        first, _ = compiler.submit(_regex(1))
        compiler.submit(_regex(2))  # queued behind the first
        with pytest.raises(OverloadedError, match="structured_outputs_max_pending_compiles"):
            compiler.submit(_regex(3))
        assert not compiler.submit(_regex(1))[1]  # a cached one still comes back: it adds no compile
        gate.set()
        _wait(first)
        _wait(compiler.submit(_regex(2))[0])
        assert compiler.submit(_regex(3))[1]
    finally:
        gate.set()
        compiler.shutdown()


def test_timeout_counts_run_time_not_queue_time_and_sticks():
    release_slow = threading.Event()

    def compile_fn(so: StructuredOutputsParams) -> str:
        if so.regex == "slow":
            release_slow.wait(10)
        return so.regex

    compiler = GrammarCompiler(compile_fn, cache_size=8, max_pending=8, timeout=0.2, workers=1)
    try:
        slow, _ = compiler.submit(StructuredOutputsParams(regex="slow"))
        quick, _ = compiler.submit(StructuredOutputsParams(regex="quick"))  # queued behind the slow one
        while compiler.failure(slow) is None:
            time.sleep(0.01)
        assert "did not compile within 0.2 s" in compiler.failure(slow)
        assert not compiler.ready(slow)
        time.sleep(0.2)  # the quick one has now waited past the timeout, but has not run yet
        assert compiler.failure(quick) is None
        release_slow.set()
        _wait(slow)
        _wait(quick)
        assert compiler.ready(quick) and quick.future.result() == "quick"
        # Finished late: still failed, and the same grammar again fails from the cache without a compile.
        assert compiler.failure(slow) is not None
        again, new = compiler.submit(StructuredOutputsParams(regex="slow"))
        assert again is slow and not new and compiler.failure(again) is not None
    finally:
        release_slow.set()
        compiler.shutdown()


def test_a_raising_compile_is_a_failure_and_shutdown_cancels_the_queue():
    gate = threading.Event()

    def compile_fn(so: StructuredOutputsParams) -> str:
        if so.regex == "bad":
            raise ValueError("the grammar does not compile: nope")
        gate.wait(10)
        return so.regex

    compiler = GrammarCompiler(compile_fn, cache_size=8, max_pending=8, workers=1)
    bad, _ = compiler.submit(StructuredOutputsParams(regex="bad"))
    _wait(bad)
    assert compiler.failure(bad) == "the grammar does not compile: nope" and not compiler.ready(bad)
    running, _ = compiler.submit(_regex(1))
    queued, _ = compiler.submit(_regex(2))
    while running.started is None:
        time.sleep(0.005)
    compiler.shutdown()
    assert queued.future.cancelled() and compiler.failure(queued) is None and not compiler.ready(queued)
    gate.set()
    _wait(running)
    assert running.future.result() == "a{1}"
