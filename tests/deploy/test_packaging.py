"""The wheel's explicit package list (pyproject.toml) names every package of the tree: a package left out installs
nowhere, and the installed pagedserve fails to import it (the checkout, where the repo root is the package, hides
that)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[2]


def test_every_package_is_in_the_wheel():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tracked = subprocess.run(["git", "ls-files", "*__init__.py"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()  # not build/ or a venv's copies
    found = {".".join(["pagedserve", *Path(f).parent.parts]) for f in tracked
             if Path(f).parts[0] not in ("tests", "benchmarks")}
    assert found - listed == set(), "packages missing from [tool.setuptools] packages"
    assert listed - found == set(), "listed packages that do not exist"
