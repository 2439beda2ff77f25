"""One process needs no Ray installed (offline on one device, as the GPU check runs); tensor parallelism without
Ray fails with an error that says so. In a subprocess, where importing Ray fails as if it were not installed."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["ray"] = None  # `import ray` now raises ModuleNotFoundError, as where Ray is not installed
from pagedserve import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", dtype="float32", attention_backend="torch", num_gpu_blocks_override=16)
out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
print("tokens", len(out[0].outputs[0].token_ids))
try:
    LLM(sys.argv[1], device="cpu", tensor_parallel_size=2)
except ImportError as e:
    print("error", e)
assert "ray" not in {m.split(".")[0] for m, mod in sys.modules.items() if mod is not None}
"""


def test_offline_engine_runs_without_ray(llama_dir):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, llama_dir], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tokens 3" in proc.stdout
    assert 'error distributed_executor_backend="ray" (tensor parallelism) needs Ray: pip install ray' in proc.stdout
