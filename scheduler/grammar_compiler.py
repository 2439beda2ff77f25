"""Grammar compiles off the caller's thread: a few daemon threads, an LRU cache keyed by the constraint, a deadline
per compile and a bound on how many may be queued or running.

llguidance releases the GIL while it builds a grammar, so a compile on these threads leaves the engine loop (and
an event loop) running. A compile cannot be interrupted: one past its deadline is reported as failed and keeps its
thread until it ends, and it still counts against the bound. Its entry stays failed in the cache, so the same
grammar sent again fails at once instead of taking a thread again.
"""
from __future__ import annotations

import json
import math
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pagedserve.common.errors import OverloadedError
from pagedserve.common.sampling_params import StructuredOutputsParams

T = TypeVar("T")
DEFAULT_WORKERS = min(4, os.cpu_count() or 1)
# llguidance recurses along a grammar's rules: a Lark chain of ~3000 rules (90 KB) overflows a default 8 MiB thread
# stack and kills the process; 256 MiB held 10000. Only the pages touched are committed.
STACK_BYTES = 256 << 20


def constraint_key(so: StructuredOutputsParams) -> tuple[str, str, bool]:
    """What determines a constraint's grammar exactly: its kind, its text and the whitespace option."""
    kind = so.kind
    value = getattr(so, kind)
    text = value if isinstance(value, str) else "" if kind == "json_object" else json.dumps(value)
    return kind, text, so.disable_any_whitespace


@dataclass(eq=False)
class Compile(Generic[T]):
    """One constraint's compile. ``started`` and ``ended`` (time.monotonic()) are set on the compiling thread."""

    future: Future[T] = field(default_factory=Future)
    started: float | None = None
    ended: float | None = None


class _DaemonWorkers:
    """Threads taking jobs in order, started on the first job. Daemons: a compile still running at exit does not
    hold the process (a ThreadPoolExecutor's threads are joined at exit, queued jobs included)."""

    def __init__(self, num: int, name: str) -> None:
        self._num, self._name = num, name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, future: Future, fn: Callable[[], T]) -> None:
        if not self._threads:
            self._threads = [threading.Thread(target=self._loop, name=f"{self._name}-{i}", daemon=True)
                             for i in range(self._num)]
            previous = threading.stack_size(STACK_BYTES)  # for the threads started here
            try:
                for t in self._threads:
                    t.start()
            finally:
                threading.stack_size(previous)
        self._jobs.put((future, fn))

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn = job
            del job  # an idle thread holds no job: the compiler it belongs to can be collected (and stop it)
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # handed to whoever waits on the future
                    future.set_exception(e)
            del future, fn

    def shutdown(self) -> None:
        """Cancel the queued jobs; the threads end after the one they run. Idempotent."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                self._jobs.get_nowait()[0].cancel()
            except queue.Empty:
                break
        for _ in self._threads:
            self._jobs.put(None)


class GrammarCompiler(Generic[T]):
    """``compile_fn`` turns a constraint into T (raising ValueError with the reason when it does not compile).
    ``cache_size`` compiles are kept, least recently used out first; at most ``max_pending`` compiles may be queued
    or running; one that takes longer than ``timeout`` seconds failed. ``setup`` (thread-safe, quick once done) runs
    on the compile thread before each compile, untimed: building the tokenizer, say."""

    def __init__(self, compile_fn: Callable[[StructuredOutputsParams], T], *, cache_size: int, max_pending: int,
                 timeout: float = math.inf, workers: int = DEFAULT_WORKERS, name: str = "grammar",
                 setup: Callable[[], None] | None = None) -> None:
        self._compile_fn = compile_fn
        self._setup = setup
        self.cache_size = cache_size
        self.max_pending = max_pending
        self.timeout = timeout
        self._workers = _DaemonWorkers(workers, name)
        weakref.finalize(self, self._workers.shutdown)
        self._cache: OrderedDict[tuple[str, str, bool], Compile[T]] = OrderedDict()
        self._unfinished: list[Compile[T]] = []
        self.num_compiles = 0  # cache misses

    def submit(self, so: StructuredOutputsParams, key: tuple[str, str, bool] | None = None
               ) -> tuple[Compile[T], bool]:
        """The constraint's compile, from the cache or started now (then True); raises ``OverloadedError`` when
        ``max_pending`` compiles are already queued or running. ``key``: its ``constraint_key`` if known."""
        key = key if key is not None else constraint_key(so)
        c = self._cache.get(key)
        if c is not None:
            self._cache.move_to_end(key)
            return c, False
        self._unfinished = [u for u in self._unfinished if not u.future.done()]
        if len(self._unfinished) >= self.max_pending:
            raise OverloadedError(f"{len(self._unfinished)} grammars are already compiling or queued, the most this "
                                  "engine takes (structured_outputs_max_pending_compiles); retry later")
        c = Compile()
        self._workers.submit(c.future, lambda: self._run(c, so))
        self._unfinished.append(c)
        self._cache[key] = c
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)  # whoever waits on an evicted compile holds it
        self.num_compiles += 1
        return c, True

    def _run(self, c: Compile[T], so: StructuredOutputsParams) -> T:
        if self._setup is not None:
            self._setup()
        c.started = time.monotonic()
        try:
            return self._compile_fn(so)
        finally:
            c.ended = time.monotonic()

    def timed_out(self, c: Compile[T]) -> bool:
        """Whether the compile ran (or has been running) longer than the timeout; judged on its own run time, not
        on time spent queued behind others."""
        if c.started is None:
            return False
        return (c.ended if c.ended is not None else time.monotonic()) - c.started > self.timeout

    def failure(self, c: Compile[T]) -> str | None:
        """Why the compile failed (it timed out, or ``compile_fn`` raised), else None (done or still running)."""
        if self.timed_out(c):
            return f"the grammar did not compile within {self.timeout:g} s (structured_outputs_compile_timeout)"
        if c.future.done() and not c.future.cancelled() and c.future.exception() is not None:
            return str(c.future.exception())
        return None

    def ready(self, c: Compile[T]) -> bool:
        """Compiled in time (its result may be taken)."""
        return c.future.done() and not c.future.cancelled() and self.failure(c) is None

    def shutdown(self) -> None:
        self._workers.shutdown()
