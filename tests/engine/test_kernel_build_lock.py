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

from pagedserve.kernels.cpu import extension as cpu_extension

pytestmark = pytest.mark.skipif(not cpu_extension.available(), reason="the C++ kernels do not build here")

LOAD = "from pagedserve.kernels.cpu import extension; extension.load(); print('loaded')"


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


def _fake_ninja(bin_dir: Path) -> None:
    bin_dir.mkdir(parents=True)
    (bin_dir / "ninja").write_text("#!/bin/sh\necho 1.10.0\n")
    (bin_dir / "ninja").chmod(0o755)


def test_each_ninja_builds_in_a_directory_of_its_own(tmp_path, monkeypatch):
    """The environment's own ninja is used whether or not the environment is activated (PATH); without one, the
    first on PATH, and another one there builds elsewhere."""
    here = cpu_extension.build_directory()
    assert cpu_extension.build_directory() == here  # stable: the cache is found again
    _fake_ninja(tmp_path / "env" / "bin")
    _fake_ninja(tmp_path / "system")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "env" / "bin" / "python"))
    own = cpu_extension.build_directory()
    monkeypatch.setenv("PATH", str(tmp_path / "system") + os.pathsep + os.environ["PATH"])
    assert cpu_extension.build_directory() == own != here
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bare" / "python"))
    assert cpu_extension.build_directory() not in (own, here)
    assert os.path.dirname(own) == os.path.dirname(here)
