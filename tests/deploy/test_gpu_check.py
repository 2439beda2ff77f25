"""benchmarks/gpu_check.sh, the one command a lent GPU machine runs, in its dry mode: every step runs its CPU-only
part (the CUDA test subsets are collected, the kernel benchmark finds no GPU, the end-to-end run parses its
arguments), so a broken path or import in it shows here, not in scarce device time."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(660)  # past its own subprocess's timeout, which names what hung
def test_gpu_check_dry_run_reaches_every_step(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "gpu-check.log").read_text()
    assert "torch" in log.split("== ")[0]
    collected = [int(n) for n in re.findall(r"^(\d+)(?:/\d+)? tests? collected", log, re.M)]
    assert len(collected) == 3 and min(collected) > 0, log[-3000:]
    assert "error" not in log.split("== kernels\n")[0].lower(), log[-3000:]
    assert "no CUDA device" in log.split("== kernels\n")[1]
    assert "--hf-static-batches" in log.split("== end to end\n")[1]
    assert "--kv-mib" in log.split("== fp8 KV cache\n")[1]
    assert sorted(os.listdir(tmp_path)) == ["gpu-check.log"]  # the device tool returns eight files at most
    bad = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--frobnicate"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown argument --frobnicate" in bad.stderr


def test_gpu_check_stops_first_when_the_engine_does_not_import(tmp_path):
    """The device image lacks llguidance: without its wheel every engine test would fail to collect, so the check
    stops before spending device time and says which wheel to carry."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "llguidance.py").write_text("raise ImportError('No module named llguidance')\n")
    out = tmp_path / "out"
    wheels = tmp_path / "wheels"  # none there (a checkout that carried them to a device keeps them in .whl/)
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, PYTHONPATH=str(shadow), WHEELS=str(wheels))
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "does not import here" in proc.stderr and f"-d {wheels} llguidance==" in proc.stderr, proc.stderr
    assert not (out / "gpu-check.log").exists()
