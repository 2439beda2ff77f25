"""A start killed while the C++ kernels were building (Ctrl-C during the first start's compile) leaves torch's
`lock` file in the build dir, and torch's loader waits for that file to go, without end: the next start must not
hang on it. Runs the next start as a real process on a copy of the built extension's dir. A second `ninja` on PATH (or
a second checkout) builds in a directory of its own, instead of rebuilding every kernel in the shared one."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.kernels import cpu_extension

pytestmark = pytest.mark.skipif(not cpu_extension.available(), reason="the C++ kernels do not build here")

LOAD = "from pagedserve.kernels import cpu_extension; cpu_extension.load(); print('loaded')"


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start(tmp_path, monkeypatch):
    built = cpu_extension.build_directory()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    copy = Path(cpu_extension.build_directory())
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "*.flock"))  # up to date: no rebuild
    # What torch's loader leaves when its process dies mid-build (it creates the file with O_EXCL, and only its
    # own process removes it).
    (copy / "lock").touch()
    proc = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-3000:]
    assert not (copy / "lock").exists()


def test_another_ninja_builds_in_a_directory_of_its_own(tmp_path, monkeypatch):
    here = cpu_extension.build_directory()
    assert cpu_extension.build_directory() == here  # stable: the cache is found again
    other = tmp_path / "bin"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\necho 1.10.0\n")
    (other / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", str(other) + os.pathsep + os.environ["PATH"])
    theirs = cpu_extension.build_directory()
    assert theirs != here and os.path.dirname(theirs) == os.path.dirname(here)
