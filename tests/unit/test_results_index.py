"""benchmarks/results/INDEX.md is what benchmarks/bench_results_index.py makes of the results beside it, lists every
file outside archive/, and those stay few: one current result set per benchmark and machine class."""
from __future__ import annotations

import re

import pytest


@pytest.fixture(scope="module")
def index(load_benchmark):
    return load_benchmark("results_index")


def current_files(index) -> list[str]:
    results = index.RESULTS
    return sorted(str(p.relative_to(results)) for p in results.rglob("*")
                  if p.is_file() and "archive" not in p.relative_to(results).parts)


def test_the_committed_index_is_up_to_date(index, tmp_path):
    out = tmp_path / "INDEX.md"
    index.main(["--out", str(out)])
    assert out.read_text() == (index.RESULTS / "INDEX.md").read_text(), \
        "run python benchmarks/bench_results_index.py and commit benchmarks/results/INDEX.md"


def test_the_index_lists_every_current_file_and_they_are_few(index):
    listed = set(re.findall(r"\]\(([^)]+)\)", (index.RESULTS / "INDEX.md").read_text()))
    files = current_files(index)
    assert set(files) - {"INDEX.md"} <= listed, set(files) - listed
    assert len(files) <= index.MAX_FILES, f"{len(files)} files outside archive/: move earlier runs there"


def test_names_split_into_benchmark_and_machine(index):
    assert index.split_name("serve_vs_vllm-kvfp8-epyc-zen5") == ("serve_vs_vllm-kvfp8", "epyc-zen5")
    assert index.split_name("vs_vllm-qwen2-05b-xeon-f6m167") == ("vs_vllm-qwen2-05b", "xeon-f6m167")
    assert index.split_name("throughput-nvidia-h100-80gb-hbm3") == ("throughput", "nvidia-h100-80gb-hbm3")
    assert index.split_name("tp-cpu-unrecorded") == ("tp", "cpu-unrecorded")
