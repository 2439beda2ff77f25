from __future__ import annotations

import subprocess
import sys

from pagedserve import LLM, SamplingParams

TIMEOUT_S = 120


def _start(*args: str) -> subprocess.Popen:
    """`pagedserve ARGS` started in the background; independent runs overlap their imports and waits."""
    return subprocess.Popen([sys.executable, "-m", "pagedserve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_generate_prints_the_completion(llama_dir):
    proc = _start("generate", "--model", llama_dir, "--max-tokens", "12", "--ignore-eos", "def main(")
    expected = LLM(llama_dir).generate("def main(", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                       use_tqdm=False)[0].outputs[0].text
    res = _result(proc)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"def main({expected}\n"
    assert "KV cache:" in res.stderr and "tok/s" in res.stderr


def test_generate_rejects_bad_input(llama_dir, tmp_path):
    bad_temperature = _start("generate", "--model", llama_dir, "--temperature", "-1", "hi")
    missing = _start("generate", "--model", str(tmp_path / "nope"), "hi")
    res = _result(bad_temperature)
    assert res.returncode == 2 and "temperature" in res.stderr
    res = _result(missing)
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_generate_with_tensor_parallelism(model_factory):
    model_dir = model_factory("llama-gqa8")
    procs = [_start("generate", "--model", model_dir, "--max-tokens", "8", "--ignore-eos", *tp, "hello")
             for tp in ((), ("-tp", "2"))]
    try:
        single, tp = (_result(p) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert single.returncode == tp.returncode == 0, tp.stderr
    assert tp.stdout == single.stdout
