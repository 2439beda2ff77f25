"""The kernels' thread pool (csrc/pool.cpp): regions from several Python threads at once, and a forked child,
compute what one thread does."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.kernels.cpu import fused as cpu_fused
from pagedserve.kernels.cpu import gemm_bf16 as cpu_gemm_bf16


@pytest.fixture(scope="module", autouse=True)
def built():
    cpu_extension.load()


def _inputs(seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 256, generator=g).bfloat16()
    w = torch.randn(512, 256, generator=g).bfloat16()
    packed = cpu_gemm_bf16.pack_weight(w) if cpu_gemm_bf16.available() else None
    return x, torch.ones(256).bfloat16(), torch.randint(0, 300, (257,), generator=g), packed


def _work(inputs: tuple) -> list[torch.Tensor]:
    """A GEMM (run_units), an RMSNorm (parallel_for) and a gather: kernels only, no torch op that uses OpenMP
    (GNU OpenMP hangs in a forked child once the parent used it)."""
    x, norm_w, ids, packed = inputs
    out = [cpu_fused.rms_norm(x, norm_w, 1e-5), cpu_fused.gather_rows(x, ids)]
    if packed is not None:
        out.append(cpu_gemm_bf16.gemm(x, packed))
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return t.view(torch.uint8).numpy().tobytes()


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_regions_from_several_threads_at_once():
    """Threads that start regions while another runs one (it runs theirs on their own thread) get the results one
    thread gets; none waits on another's region for ever."""
    torch.set_num_threads(2)
    inputs = {s: _inputs(s) for s in range(4)}
    want = {s: _work(inputs[s]) for s in range(4)}
    errors: list[str] = []

    def loop(seed: int) -> None:
        for _ in range(20):
            if not _same(_work(inputs[seed]), want[seed]):
                errors.append(f"thread {seed}: results differ")
                return

    threads = [threading.Thread(target=loop, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a region never ended"
    assert not errors


def test_forked_child_starts_its_own_workers():
    """A child forked after the parent's workers ran has none of them: it starts its own, and its regions end."""
    torch.set_num_threads(2)
    inputs = _inputs(7)
    want = [_bytes(t) for t in _work(inputs)]
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the same results come back (compared without torch ops)
        try:
            os._exit(0 if [_bytes(t) for t in _work(inputs)] == want else 1)
        except BaseException:
            os._exit(2)
    for _ in range(600):  # 60 s
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        threading.Event().wait(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's kernels hung")
    assert os.waitstatus_to_exitcode(status) == 0


def test_kernels_let_other_python_threads_run():
    """A kernel runs without the GIL: a served engine's event loop and Ray's threads share its process, and a
    prefill layer of a 1B model runs for most of a second. While one long call runs, another Python thread keeps
    going; holding the GIL, the call would leave it not one bytecode. The margins leave out that thread's turns
    just before and after a call (Python hands the GIL over every 5 ms)."""
    x, w = torch.randn(65536, 2048), torch.ones(2048)  # 512 MiB: tens of ms a call on one thread
    out = torch.empty_like(x)
    kernels = cpu_extension.load()
    threads = torch.get_num_threads()
    ticks: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())

    spinner = threading.Thread(target=spin)
    torch.set_num_threads(1)  # a longer call, and a core for the other thread
    spinner.start()
    try:
        calls = []
        for _ in range(3):
            start = time.perf_counter()
            kernels.rms_norm(x, w, 1e-5, out)
            calls.append((start + 0.01, time.perf_counter() - 0.01))
    finally:
        stop.set()
        spinner.join()
        torch.set_num_threads(threads)
    inside = [sum(1 for t in ticks if a < t < b) for a, b in calls if b - a > 0.005]
    assert inside, [b - a for a, b in calls]  # no call was long enough to tell
    assert max(inside) > 1000, inside
