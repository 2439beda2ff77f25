from __future__ import annotations

import subprocess
import sys

from pagedserve import LLM, SamplingParams


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve", *args], capture_output=True,
                          text=True, timeout=120)


def test_generate_prints_the_completion(llama_dir):
    res = _cli("generate", "--model", llama_dir, "--max-tokens", "12", "--ignore-eos", "def main(")
    assert res.returncode == 0, res.stderr
    expected = LLM(llama_dir).generate("def main(", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                       use_tqdm=False)[0].outputs[0].text
    assert res.stdout == f"def main({expected}\n"
    assert "KV cache:" in res.stderr and "tok/s" in res.stderr


def test_generate_rejects_bad_input(llama_dir, tmp_path):
    res = _cli("generate", "--model", llama_dir, "--temperature", "-1", "hi")
    assert res.returncode == 2 and "temperature" in res.stderr
    res = _cli("generate", "--model", str(tmp_path / "nope"), "hi")
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_generate_with_tensor_parallelism(model_factory):
    model_dir = model_factory("llama-gqa8")
    single = _cli("generate", "--model", model_dir, "--max-tokens", "8", "--ignore-eos", "hello")
    tp = _cli("generate", "--model", model_dir, "--max-tokens", "8", "--ignore-eos", "-tp", "2", "hello")
    assert single.returncode == tp.returncode == 0, tp.stderr
    assert tp.stdout == single.stdout
