"""`pagedserve serve` as a real process serving HTTP beside gRPC, as in production: one API key and one pair of
TLS files for both, 503 while loading, 401 without the key, 429 with Retry-After when the waiting queue is full,
400 on chat for a model without a chat template, and on SIGTERM a drain (503 for new requests and for health, the
running stream finishes, exit 0)."""
from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import threading
import time

import httpx2
import openai
import pytest

from pagedserve.tests.server_thread import free_port

KEY = "s3cret-http-key"
FILE_KEY = "second-key-from-a-file"
PS = [sys.executable, "-m", "pagedserve"]


class Served:
    def __init__(self, proc: subprocess.Popen, url: str, cert: str, log: str, health_seen: list[int]) -> None:
        self.proc, self.url, self.cert, self.log, self.health_seen = proc, url, cert, log, health_seen
        self.ssl = ssl.create_default_context(cafile=cert)

    def http(self, **kw) -> httpx2.Client:
        return httpx2.Client(base_url=self.url, verify=self.ssl, timeout=30, **kw)

    def sdk(self, api_key: str = KEY, strict: bool = True) -> openai.OpenAI:
        """``strict=False`` for streamed completions, whose null finish_reason the SDK's Completion type refuses."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60,
                             http_client=httpx2.Client(verify=self.ssl), _strict_response_validation=strict)


@pytest.fixture(scope="module")
def served(ray_cluster, llama_dir, tls_files, tmp_path_factory):
    cert, key = tls_files
    http_port = free_port()
    log = str(tmp_path_factory.mktemp("serve") / "serve.log")
    key_file = tmp_path_factory.mktemp("secret") / "api-keys"
    key_file.write_text(FILE_KEY + "\n")
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            PS + ["serve", "--model", llama_dir, "--host", "127.0.0.1", "--grpc-port", str(free_port()),
                  "--port", str(http_port), "--metrics-port", "0", "--api-key", KEY,
                  "--api-key-file", str(key_file), "--ssl-certfile", cert,
                  "--ssl-keyfile", key, "--max-num-seqs", "1", "--max-waiting-requests", "1", "--drain-timeout", "60"],
            env=env, stdout=out, stderr=subprocess.STDOUT)
    s = Served(proc, f"https://127.0.0.1:{http_port}", cert, log, [])
    deadline = time.monotonic() + 120
    with s.http() as c:
        while True:
            assert proc.poll() is None, open(log).read()[-3000:]
            assert time.monotonic() < deadline, "not serving after 120 s"
            try:
                r = c.get("/health")
            except httpx2.TransportError:  # not listening yet
                time.sleep(0.05)
                continue
            if not s.health_seen or s.health_seen[-1] != r.status_code:
                s.health_seen.append(r.status_code)
                if r.status_code == 503:
                    s.loading_body = r.json()
            if r.status_code == 200:
                break
            time.sleep(0.05)
    yield s
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def test_cached_prompt_tokens_are_not_reported_by_default(served):
    """Without --enable-prompt-tokens-details usage has no prompt_tokens_details: a tenant cannot probe what another
    cached (with the flag: test_openai_api.py's test_prefix_cache_hits_show_in_usage)."""
    with served.http(headers={"Authorization": f"Bearer {KEY}"}) as c:
        prompt = list(range(5, 125))
        for _ in range(2):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 120
            assert r.json()["usage"].get("prompt_tokens_details") is None


def test_503_while_loading_then_200(served):
    assert served.health_seen == [503, 200]
    assert served.loading_body["error"]["message"] == "not serving: loading"


def test_api_key_required(served):
    with served.http() as c:
        assert c.get("/health").status_code == 200  # probes and scrapers need no key
        assert c.get("/metrics").status_code == 200
        for method, path, body in [("POST", "/v1/completions", {"prompt": "x"}), ("GET", "/v1/models", None),
                                   ("POST", "/tokenize", {"prompt": "x"})]:
            r = c.request(method, path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            r = c.request(method, path, json=body, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401, path
    for key in ("wrong", "Bearer " + KEY):
        with served.sdk(api_key=key) as bad, pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=None, prompt="class", max_tokens=2)
    with served.sdk() as c:
        assert c.completions.create(model=None, prompt="class", max_tokens=2).usage.completion_tokens == 2
        assert [m.id for m in c.models.list().data] == [os.path.basename(served_model_dir(served))]
    with served.sdk(api_key=FILE_KEY) as c:  # either key: --api-key and --api-key-file add up
        assert c.completions.create(model=None, prompt="class", max_tokens=2).usage.completion_tokens == 2


def served_model_dir(served) -> str:
    args = served.proc.args
    return args[args.index("--model") + 1]


def test_plaintext_client_cannot_talk_to_tls_server(served):
    with pytest.raises(httpx2.TransportError):
        httpx2.get(served.url.replace("https://", "http://") + "/health", timeout=5)


def test_chat_without_a_template_is_400(served):
    with served.sdk() as c, pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=None, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "no chat template" in err.value.message and "--chat-template" in err.value.message
    assert err.value.body["param"] == "messages"


def _sample(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.split("{")[0] == name)


def _running_and_waiting(c: openai.OpenAI, h: httpx2.Client, long: dict, first: list,
                         second: list) -> list[threading.Thread] | None:
    """Streams one request into ``first`` and queues a second behind it into ``second``; returns their reader threads
    once the second is seen waiting, or None when the first ended before that (a slow host), to be tried again."""
    first.clear()
    second.clear()
    readers = [threading.Thread(target=lambda out=out, p=p: out.extend(c.completions.create(prompt=p, **long)))
               for out, p in ((first, "class"), (second, "def"))]
    readers[0].start()
    while not first and readers[0].is_alive():
        time.sleep(0.01)
    assert first, "the first request failed"
    readers[1].start()
    while _sample(h.get("/metrics").text, "pagedserve_num_requests_waiting") < 1:
        if not readers[0].is_alive():
            readers[1].join(60)
            return None
        time.sleep(0.02)  # a scrape loop without a pause would take the gateway's share of a small host
    return readers


def test_full_queue_is_429_with_retry_after(served):
    """max_num_seqs=1 and one waiting place: with one request running and one waiting, a third is refused at once
    (429, Retry-After); the two others finish."""
    long = dict(model=None, max_tokens=250, temperature=0.0, extra_body={"ignore_eos": True}, stream=True)
    with served.sdk(strict=False) as c, served.http() as h:
        first: list = []
        second: list = []
        for _ in range(3):
            readers = _running_and_waiting(c, h, long, first, second)
            if readers is not None:
                break
        assert readers is not None, "the first request ended each time before the second one was queued"
        with pytest.raises(openai.RateLimitError) as err:
            c.completions.create(model=None, prompt="import", max_tokens=2)
        assert err.value.response.headers["retry-after"] == "1"
        assert "waiting queue is full" in err.value.message
        for r in readers:
            r.join(60)
        assert sum(len(ch.choices) for ch in first) == 250
        assert sum(len(ch.choices) for ch in second) == 250


def test_sigterm_drains_http(served):
    """Run last in this module: it stops the server."""
    with served.sdk(strict=False) as c:
        stream = c.completions.create(model=None, prompt="class", max_tokens=120, temperature=0.0, stream=True,
                                      extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        rest = threading.Thread(target=lambda: chunks.extend(stream))
        rest.start()
        served.proc.send_signal(signal.SIGTERM)
        with served.http() as h:
            deadline = time.monotonic() + 10
            while h.get("/health").status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert h.get("/health").json()["error"]["message"] == "not serving: draining"
        with pytest.raises(openai.InternalServerError) as err:
            c.completions.create(model=None, prompt="def", max_tokens=2)
        assert err.value.status_code == 503 and "shutting down" in err.value.message
        rest.join(60)
    assert sum(len(ch.choices) for ch in chunks) == 120  # the running request finished during the drain
    assert chunks[-1].choices[0].finish_reason == "length"
    assert served.proc.wait(60) == 0
    assert "stopped" in open(served.log).read()
