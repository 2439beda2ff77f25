"""Real tools against the HTTP API (with an API key): lm-evaluation-harness (`local-completions`) on two local
tasks, its loglikelihoods equal to Hugging Face's on the same model within 1e-4 and its generations equal to the
offline engine's; then schemathesis fuzzing every operation of /openapi.json: no 5xx, no hang, answers as the spec
says, and afterwards the server still serves with every KV block free."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx2
import openai
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.common.config import default_model_dir
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.tests.server_thread import ServerThread, free_port

KEY = "tools-key"
MODEL = "tiny-llama"
TASKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "lm_eval")


@pytest.fixture(scope="module")
def server(ray_cluster, llama_dir):
    # A concurrency limit bounds what the fuzzer may ask of the engine at once (its n x prompts count against it).
    srv = ServerThread(EngineArgs(model=llama_dir, seed=0), http_port=free_port(), served_model_name=MODEL,
                       api_key=KEY, chat_template=f"{default_model_dir()}/chat_template.jinja",
                       max_concurrent_requests=32).start()
    yield srv
    srv.stop()


def _hf_loglikelihood(model, ids: list[int], n_ctx: int) -> float:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return sum(logprobs[i - 1, ids[i]].item() for i in range(n_ctx, len(ids)))


def test_lm_eval_loglikelihood_and_generate_until(server, llama_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # local-completions sends it as 'Authorization: Bearer'
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_args = {"model": MODEL, "base_url": f"{server.http_url}/v1/completions", "tokenizer_backend": "huggingface",
                  "tokenizer": llama_dir, "tokenized_requests": True, "num_concurrent": 4, "max_retries": 1,
                  "max_length": 256, "max_gen_toks": 16}
    results = lm_eval.simple_evaluate(
        model="local-completions", model_args=model_args, tasks=["pagedserve_tiny_loglik", "pagedserve_tiny_generate"],
        task_manager=TaskManager(include_path=TASKS, include_defaults=False), log_samples=True, bootstrap_iters=0,
        random_seed=0)
    samples = results["samples"]

    tok = AutoTokenizer.from_pretrained(llama_dir)
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    loglik = samples["pagedserve_tiny_loglik"]
    assert len(loglik) == 6 and sum(len(s["arguments"]) for s in loglik) == 18
    worst = 0.0
    for s in loglik:
        for (context, continuation), (ll, _greedy) in zip(s["arguments"], [r[0] for r in s["resps"]]):
            ids = tok.encode(context + continuation, add_special_tokens=False)
            n_ctx = len(tok.encode(context, add_special_tokens=False))
            assert ids[:n_ctx] == tok.encode(context, add_special_tokens=False)
            worst = max(worst, abs(ll - _hf_loglikelihood(hf, ids, n_ctx)))
    print(f"lm-eval loglikelihoods vs HF: worst |difference| {worst:.1e}")
    assert worst < 1e-4, worst
    assert 0.0 <= results["results"]["pagedserve_tiny_loglik"]["acc,none"] <= 1.0

    offline = LLM(llama_dir, seed=0)
    gen = samples["pagedserve_tiny_generate"]
    assert len(gen) == 4
    prompts = [s["arguments"][0][0] for s in gen]
    exp = offline.generate([{"prompt_token_ids": tok.encode(p, add_special_tokens=False)} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=16, stop=["\n\n", tok.eos_token]),
                           use_tqdm=False)
    assert [s["resps"][0][0] for s in gen] == [e.outputs[0].text for e in exp]
    assert any(e.outputs[0].text for e in exp)


def test_schemathesis_finds_no_server_error(server, tmp_path):
    report = tmp_path / "report"
    cmd = [os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run", f"{server.http_url}/openapi.json",
           "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
                       "response_schema_conformance,ignored_auth",
           "--header", f"Authorization: Bearer {KEY}", "--max-examples", "20", "--seed", "20240601",
           "--request-timeout", "30", "--workers", "1", "--phases", "examples,coverage,fuzzing",
           "--suppress-health-check", "all", "--no-shrink", "--report", "junit", "--report-dir", str(report),
           # The admin routes change the replica set (tested in test_elastic.py); fuzzing them would place replicas.
           "--exclude-path-regex", "^/(scale_elastic_ep|rollout)$"]
    t = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "passed" in proc.stdout.lower()
    print(f"schemathesis: {time.monotonic() - t:.1f} s;", proc.stdout.strip().splitlines()[-1])
    # The fuzzer got through to the engine, not only to the request validation.
    metrics = httpx2.get(f"{server.http_url}/metrics").text
    finished = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("pagedserve_requests_finished_total{") and 'protocol="http"' in line)
    assert finished >= 10, finished
    # Still serving afterwards, with nothing left running and every block free.
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=KEY, max_retries=0,
                       _strict_response_validation=True) as c:
        assert c.completions.create(model=MODEL, prompt="class", max_tokens=3).usage.completion_tokens == 3
    deadline = time.monotonic() + 20
    with server.client(api_key=KEY) as g:
        while True:
            info = g.model_info()
            if info.num_running_requests == 0 and info.num_waiting_requests == 0 and info.kv_cache_usage == 0.0:
                break
            assert time.monotonic() < deadline, f"KV blocks not freed: {info}"
            time.sleep(0.05)
        assert info.num_free_kv_blocks == info.num_kv_blocks
