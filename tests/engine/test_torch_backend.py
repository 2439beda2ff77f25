"""``--attention-backend torch`` means torch everywhere: a whole engine runs without building or loading the C++
extension (a fresh process and extensions folder, so nothing this session built can hide a call)."""
from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import sys
from pagedserve import LLM, SamplingParams
from pagedserve.kernels.cpu import extension
with LLM(attention_backend="torch") as llm:
    [out] = llm.generate(["def fib(n):"], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
assert len(out.outputs[0].token_ids) == 6, out
assert extension._module is None and extension._error is None, "the C++ extension was built, or its build tried"
assert extension.NAME not in sys.modules
print("ok")
"""


def test_torch_backend_builds_no_cpp(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").rglob("*.so"))
