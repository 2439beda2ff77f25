"""No top-level name of the checkout shadows a dependency. The checkout root is the ``pagedserve`` package, so
wherever the root is on ``sys.path`` (a shell or ``python -c`` in the checkout, ``python -m``, Ray workers started
there) its folders and modules are also top-level names, and ``benchmarks/``'s modules are where a benchmark runs.
A module always wins over a later one of its name; a package folder of the root yields its name to any other module
of that name (``pagedserve._yield_top_level_name``); a folder without ``__init__.py`` is a PEP 420 portion, which
never wins over a regular package. tests/cluster/test_fresh_install.py imports them all from the root."""
from __future__ import annotations

import importlib.metadata
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUARD = "_yield_top_level_name(__name__)"
ENTRY_MODULES = {"__init__", "__main__"}  # `import __init__` / `import __main__` name no distribution


@dataclass(frozen=True)
class TopLevelName:
    name: str
    path: Path
    shadows: bool  # wins over a module of the same name later on sys.path


def top_level_names(folder: Path) -> list[TopLevelName]:
    """What ``folder`` provides as top-level names when it is on ``sys.path``."""
    names = []
    for entry in sorted(folder.iterdir()):
        if entry.is_dir() and entry.name.isidentifier():
            init = entry / "__init__.py"
            shadows = init.exists() and GUARD not in init.read_text()
            names.append(TopLevelName(entry.name, entry, shadows))
        elif entry.suffix == ".py" and entry.stem not in ENTRY_MODULES:
            names.append(TopLevelName(entry.stem, entry, True))
    return names


def installed_top_level_names() -> dict[str, str]:
    """Top-level module name -> who provides it: an installed distribution, or the standard library."""
    owners = {name: "the standard library" for name in sys.stdlib_module_names}
    for name, dists in importlib.metadata.packages_distributions().items():
        if "pagedserve" not in dists:
            owners[name] = f"the distribution {', '.join(dists)}"
    return owners


def test_the_lister_sees_what_would_shadow(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "guarded").mkdir()
    (tmp_path / "guarded" / "__init__.py").write_text(f"if '.' not in __name__:\n    {GUARD}\n")
    (tmp_path / "portion").mkdir()
    (tmp_path / "json.py").write_text("")
    (tmp_path / "__main__.py").write_text("")
    found = {n.name: n.shadows for n in top_level_names(tmp_path)}
    assert found == {"kernels": True, "guarded": False, "portion": False, "json": True}
    owners = installed_top_level_names()
    assert owners["json"] == "the standard library" and "kernels" in owners  # Hugging Face's, a test dependency


def test_no_name_of_the_root_or_benchmarks_shadows_an_installed_module():
    owners = installed_top_level_names()
    clashes = [f"{n.path.relative_to(ROOT)} hides {n.name!r} of {owners[n.name]}"
               for folder in (ROOT, ROOT / "benchmarks") for n in top_level_names(folder)
               if n.shadows and n.name in owners]
    assert not clashes, clashes


def test_the_root_holds_no_module_and_every_package_folder_yields_its_name():
    """By design, not by today's distributions: a module at the root would win over any module of its name."""
    shadowing = [str(n.path.relative_to(ROOT)) for n in top_level_names(ROOT) if n.shadows]
    assert not shadowing, f"move these into a folder, or give the folder pagedserve's guard: {shadowing}"
    assert (ROOT / "kernels" / "__init__.py").exists()  # a guarded package, not a portion: import-linter sees it


def test_benchmark_modules_are_named_bench():
    """A benchmark's folder is first on its ``sys.path``: its modules carry a prefix no dependency uses."""
    assert [n.name for n in top_level_names(ROOT / "benchmarks") if n.shadows and not n.name.startswith("bench_")] \
        == []
