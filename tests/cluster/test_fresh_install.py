"""A fresh install used from inside the checkout, where the root's folders are top-level names: transformers (with
Hugging Face's ``kernels``) and tensor parallelism on Ray work from the root and from ``benchmarks/``, and a failed
engine start leaves nothing reserved behind it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pagedserve import LLM
from pagedserve.tests.utils import assert_greedy_equals_hf, random_prompts

ROOT = Path(__file__).resolve().parents[2]

# Run as `python -c` in the given folder: '' (that folder) first on sys.path, the order a user's shell gives.
SCRIPT = """
import importlib, json, os, sys
root = os.path.realpath(sys.argv[1])
assert os.path.realpath(sys.path[0] or os.curdir) == os.getcwd(), sys.path[:2]
from transformers.models.llama import modeling_llama  # imports Hugging Face's kernels
import kernels
assert hasattr(kernels, "get_kernel"), kernels.__file__
assert not kernels.__file__.startswith(os.path.join(root, "kernels")), kernels.__file__
names = [n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n)) and n.isidentifier()]
sys.path.insert(0, root)  # the root's folders as top-level names, from either folder
found = {}
for name in names:
    try:
        found[name] = getattr(importlib.import_module(name), "__file__", None)
    except ModuleNotFoundError:
        found[name] = None
from pagedserve import LLM, SamplingParams
with LLM(tensor_parallel_size=2) as llm:
    out = llm.generate(["def fib(n):"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0]
print(json.dumps({"found": found, "token_ids": list(out.token_ids), "finish_reason": out.finish_reason}))
"""


@pytest.mark.parametrize("folder", [".", "benchmarks"])
def test_transformers_kernels_and_tp2_from_inside_the_checkout(folder):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT)], cwd=ROOT / folder, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"kernels", "worker", "engine", "common", "tests"} <= set(result["found"])
    inside = {n: f for n, f in result["found"].items() if f is not None and f.startswith(str(ROOT / n) + os.sep)}
    assert not inside, f"top-level names that resolved to the checkout's own files: {inside}"
    assert len(result["token_ids"]) == 8 and result["finish_reason"] == "length"


def _live_placement_groups(ray) -> list[str]:
    return sorted(pg["name"] for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED")


def _free_cpus_return_to(ray, cpus: float, timeout: float = 10.0) -> bool:
    """Whether the cluster's free CPUs are back to ``cpus`` within ``timeout`` (Ray reports them a moment late)."""
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0.0) != cpus:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_failed_tp_start_releases_what_it_reserved(ray_cluster, model_factory, tmp_path):
    """Weights missing a tensor: both ranks fail to load, and the LLM raises with its placement group and actors gone
    (their CPUs free again), so the next engine in this process starts."""
    good = model_factory("llama-gqa8")
    bad = tmp_path / "missing-tensor"
    bad.mkdir()
    for f in os.listdir(good):
        if f != "model.safetensors":
            (bad / f).write_bytes((Path(good) / f).read_bytes())
    weights = load_file(os.path.join(good, "model.safetensors"))
    del weights["model.layers.0.mlp.down_proj.weight"]
    save_file(weights, str(bad / "model.safetensors"))
    pgs, cpus = _live_placement_groups(ray_cluster), ray_cluster.available_resources().get("CPU", 0.0)
    with pytest.raises(Exception, match="down_proj"):
        LLM(str(bad), tensor_parallel_size=2, distributed_executor_backend="ray")
    assert _live_placement_groups(ray_cluster) == pgs
    assert _free_cpus_return_to(ray_cluster, cpus), ray_cluster.available_resources()
    with LLM(good, tensor_parallel_size=2, distributed_executor_backend="ray") as llm:
        assert_greedy_equals_hf(llm, good, random_prompts(3, seed=64), 8)
    assert _live_placement_groups(ray_cluster) == pgs
