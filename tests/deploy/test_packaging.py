"""The wheel's explicit package list (pyproject.toml) names every package of the tree: a package left out installs
nowhere, and the installed pagedserve fails to import it (the checkout, where the repo root is the package, hides
that)."""
from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[2]


def test_every_package_is_in_the_wheel():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(["pagedserve", *p.parent.relative_to(REPO).parts])
             for p in REPO.rglob("__init__.py")
             if p.parent.relative_to(REPO).parts[:1] not in (("tests",), ("benchmarks",))
             and not any(part.startswith(".") for part in p.parent.relative_to(REPO).parts)}
    assert found - listed == set(), "packages missing from [tool.setuptools] packages"
    assert listed - found == set(), "listed packages that do not exist"
