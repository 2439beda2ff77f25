"""The offline API's resources live as long as the LLM: built, dropped and built again (as `with LLM(...)`, which
releases on exit) in one process on a Ray with room for one TP=2 engine; a second engine while the first holds the
CPUs fails within seconds saying which placement group holds them; nothing is left placed at the end. Run in a
subprocess, with a Ray instance of its own sized so that two engines cannot fit."""
from __future__ import annotations

import json
import subprocess
import sys
import time

SCRIPT = r"""
import json, sys, time
import ray
from pagedserve import LLM, SamplingParams

model = sys.argv[1]
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
params = SamplingParams(temperature=0, max_tokens=4)
report = {}
llm = LLM(model, tensor_parallel_size=2)
report["first"] = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
t = time.monotonic()
try:
    LLM(model, tensor_parallel_size=2)
    report["held"] = None
except RuntimeError as e:
    report["held"] = [time.monotonic() - t, str(e)]
llm = None  # the last reference: its actors and placement group go now
t = time.monotonic()
with LLM(model, tensor_parallel_size=2) as again:
    report["rebuild_s"] = time.monotonic() - t
    report["again"] = again.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
report["placed_after"] = [pg["name"] for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"]
print("REPORT " + json.dumps(report))
"""


def test_build_drop_rebuild_and_context_manager(model_factory):
    model_dir = model_factory("llama-gqa8")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT, model_dir], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    report = json.loads(lines[-1][len("REPORT "):])
    waited, why = report["held"]
    assert waited < 15, f"the refusal took {waited:.1f} s"  # seconds, not Ray's 120 s timeout
    assert "held by placement group(s) pagedserve-llm-" in why and "2 CPU" in why
    assert report["rebuild_s"] < 60  # no wait for a timeout: the dropped engine's resources were free
    assert report["first"] == report["again"]
    assert report["placed_after"] == []
    assert time.monotonic() - t0 < 240
