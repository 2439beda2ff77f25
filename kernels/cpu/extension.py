"""Builds the C++ CPU kernels of ``csrc/`` into one extension on first use.

Compiled with ``-march=native`` where it runs, with torch's extension loader and the environment's own ``ninja``
where it has one (cached under ``TORCH_EXTENSIONS_DIR``, in a directory of its own per source tree, torch install and
``ninja``). Where it cannot be built, :func:`load` raises :class:`KernelBuildError`, which says how to run on torch
ops instead.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch.utils import cpp_extension

CSRC = Path(__file__).parent / "csrc"
SOURCES = ["attention.cpp", "attention_amx.cpp", "attention_bf16.cpp", "fused.cpp", "gemm.cpp", "gemm_bf16.cpp",
           "gemm_int8.cpp", "layer.cpp", "moe.cpp", "moe_bf16.cpp", "pool.cpp", "sampling.cpp", "stream.cpp",
           "bindings.cpp"]
# -ffp-contract=fast: a * b + c as one FMA (ISO C++ mode turns contraction off).
CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


class KernelBuildError(RuntimeError):
    """The C++ kernels did not build; the message names the fallback."""


NAME = "pagedserve_cpu_kernels"
_module: ModuleType | None = None
_error: KernelBuildError | None = None


def load() -> ModuleType:
    """The compiled extension, built on the first call; raises :class:`KernelBuildError` (the same one on every
    later call) where it cannot be built."""
    global _module, _error
    if _error is not None:
        raise _error
    if _module is None:
        try:
            build_dir = build_directory()
            os.makedirs(build_dir, exist_ok=True)
            # torch's loader marks a build with a `lock` file and waits, without end, for it to go: a process
            # killed mid-build (Ctrl-C on the first start) left every later start hanging. A flock dies with its
            # holder, so the one holding it knows that any `lock` file left there belongs to a dead build.
            with open(os.path.join(build_dir, "pagedserve.flock"), "w") as held:
                fcntl.flock(held, fcntl.LOCK_EX)
                try:
                    os.remove(os.path.join(build_dir, "lock"))
                except FileNotFoundError:
                    pass
                with _ninja_first_on_path():
                    _module = cpp_extension.load(
                        name=NAME, sources=[str(CSRC / s) for s in SOURCES], build_directory=build_dir,
                        extra_include_paths=[str(CSRC)], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
                        verbose=bool(os.environ.get("PAGEDSERVE_VERBOSE_BUILD")))
        except Exception as e:  # a missing compiler or ninja, or a compile error
            _error = KernelBuildError(_message(e))
            raise _error from e
    return _module


def build_directory() -> str:
    """Where the extension is built and cached: torch's default place for a CPU extension, in a directory named
    after what its build commands depend on. Two checkouts, or two ``ninja`` versions (a system one, and the
    environment's when it is activated), sharing one directory rebuilt every kernel (a minute on 2 cores) at each
    start that alternated between them: the commands' paths differ, and each ninja discards the other's build log."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    ninja = _ninja()
    key = "\0".join([str(CSRC.resolve()), os.path.dirname(torch.__file__), os.path.realpath(ninja) if ninja else ""])
    tag = hashlib.sha1(key.encode()).hexdigest()[:10]
    return os.path.join(root, f"py{sys.version_info.major}{sys.version_info.minor}_cpu", f"{NAME}-{tag}")


def _ninja() -> str:
    """The ninja a build runs: the environment's own (the `ninja` package's, beside this Python) where it has one,
    whether or not the environment is activated; else the first on PATH ("" if none)."""
    own = os.path.join(os.path.dirname(sys.executable), "ninja")
    return own if os.access(own, os.X_OK) else shutil.which("ninja") or ""


@contextlib.contextmanager
def _ninja_first_on_path():
    """torch's loader runs ``ninja`` from PATH: put :func:`_ninja`'s directory first while it builds."""
    ninja, before = _ninja(), os.environ.get("PATH", "")
    if ninja:
        os.environ["PATH"] = os.path.dirname(ninja) + os.pathsep + before
    try:
        yield
    finally:
        os.environ["PATH"] = before


def available() -> bool:
    """Whether the extension is built or builds now; False where :func:`load` raises."""
    try:
        load()
    except KernelBuildError:
        return False
    return True


def _message(e: Exception) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    # The compiler's diagnostics first; else torch's own message (no ninja, no compiler).
    gist = ([line for line in lines if "error:" in line] or [line for line in lines if "error" in line.lower()]
            or lines[-5:])[:5]
    return ("the C++ CPU kernels (pagedserve/kernels/cpu/csrc) failed to build:\n  "
            + "\n  ".join(line[:300] for line in gist)
            + "\nThey need a C++ compiler with OpenMP and ninja on PATH (pip's ninja package puts it in "
            "the environment's bin/); PAGEDSERVE_VERBOSE_BUILD=1 prints the build log. To run on torch ops instead "
            "(slower), pass attention_backend=\"torch\" (CLI: --attention-backend torch).")
