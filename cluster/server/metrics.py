"""The gateway's Prometheus endpoint (``--metrics-port``): request-level metrics measured here, plus the engines'
metrics (every replica's, from a snapshot the gateway's loop refreshes: see ``engine_metrics``), all in one scrape
and all labelled ``model_name``."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app

from pagedserve.cluster.server.engine_metrics import EngineCollector
from pagedserve.cluster.server.vllm_metrics import COMPAT_MODES, VllmCompatCollector
from pagedserve.cluster.shared import ITL_BUCKETS, LATENCY_BUCKETS, TOKEN_BUCKETS
from pagedserve.engine.core_types import DEFAULT_TENANT


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # no line per scrape on stderr
        pass


PROTOCOLS = ("grpc", "http")
FINISH_REASONS = ("stop", "length", "abort", "error")
# Every status an error can end with, as gRPC's code names (HTTP statuses map onto these).
ERROR_CODES = ("INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "UNAVAILABLE", "INTERNAL")
TENANT_LIMITS = ("concurrent", "queued")  # why a tenant's request was refused (--tenant-max-concurrent / -queued)
OTHER_TENANTS = "other"  # the tenant label of every tenant past --tenant-metrics-max-labels


class TenantLabels:
    """The ``tenant`` label of each tenant name: its own for the ``fixed`` ones (the default tenant and the tenants
    file's) and for the first ``max_labels`` others seen, "other" for every later one. A name keeps its label for
    the life of the process: a label that moved between series would break rate()."""

    def __init__(self, fixed: Iterable[str], max_labels: int) -> None:
        self.fixed = set(fixed)
        self.max_labels = max_labels
        self._seen: set[str] = set()  # the others that got their own label

    def __call__(self, name: str) -> str:
        if name in self.fixed or name in self._seen:
            return name
        if len(self._seen) < self.max_labels:
            self._seen.add(name)
            return name
        return OTHER_TENANTS


class GatewayMetrics:
    """Request metrics, labelled ``model_name`` and ``protocol`` ("grpc" or "http"). Errors carry gRPC's canonical
    code names for both protocols (an HTTP 400 counts as INVALID_ARGUMENT, a 429 as RESOURCE_EXHAUSTED, ...)."""

    def __init__(self, model_name: str, engine_metrics: bool = True, compat: str = "vllm") -> None:
        """``compat``: "vllm" also exports vLLM's names for the same series (``vllm_metrics``); "none" does not."""
        if compat not in COMPAT_MODES:
            raise ValueError(f"metrics compat must be one of {', '.join(COMPAT_MODES)}, got {compat!r}")
        self.model_name = model_name
        self._http = None
        self.registry = CollectorRegistry(auto_describe=True)
        self.engines = EngineCollector(model_name, engine_metrics)
        self.registry.register(self.engines)
        m, reg = ["model_name", "protocol"], dict(registry=self.registry)
        self.finished = Counter("pagedserve_requests_finished", "Requests finished, by reason: stop, length, "
                                "abort (client cancel, deadline or Abort) or error.", [*m, "finish_reason"], **reg)
        self.errors = Counter("pagedserve_request_errors", "Generation requests that ended with an error status, "
                              "by gRPC code name (HTTP statuses mapped to them).", [*m, "code"], **reg)
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "Prompt tokens of admitted requests.", m, **reg)
        self.generation_tokens = Counter("pagedserve_generation_tokens", "Tokens streamed to clients.", m, **reg)
        self.ttft = Histogram("pagedserve_time_to_first_token_seconds", "Request received to first token sent.",
                              m, buckets=LATENCY_BUCKETS, **reg)
        self.itl = Histogram("pagedserve_inter_token_latency_seconds", "Gap between consecutive streamed chunks.",
                             m, buckets=ITL_BUCKETS, **reg)
        self.tpot = Histogram("pagedserve_time_per_output_token_seconds",
                              "Per request: (end-to-end - time to first token) / (output tokens - 1).",
                              m, buckets=ITL_BUCKETS, **reg)
        self.e2e = Histogram("pagedserve_e2e_request_latency_seconds", "Request received to last token sent.",
                             m, buckets=LATENCY_BUCKETS, **reg)
        self.prompt_len = Histogram("pagedserve_request_prompt_tokens", "Prompt length of admitted requests.",
                                    m, buckets=TOKEN_BUCKETS, **reg)
        self.generation_len = Histogram("pagedserve_request_generation_tokens", "Output tokens of finished requests.",
                                        m, buckets=TOKEN_BUCKETS, **reg)
        self.max_tokens = Histogram("pagedserve_request_max_generation_tokens",
                                    "max_tokens of admitted requests (the most each may generate).",
                                    m, buckets=TOKEN_BUCKETS, **reg)
        # Per tenant (both protocols together), its label bounded by TenantLabels.
        t = ["model_name", "tenant"]
        self._tenant_requests = Counter("pagedserve_tenant_requests", "Generation requests let in past their "
                                        "tenant's limits, by tenant.", t, **reg)
        self._tenant_rejected = Counter("pagedserve_tenant_rejected_requests", "Generation requests refused at once "
                                        "(HTTP 429, RESOURCE_EXHAUSTED) at their tenant's limit, by reason: "
                                        "concurrent (--tenant-max-concurrent) or queued (--tenant-max-queued).",
                                        [*t, "reason"], **reg)
        self._tenant_prompt_tokens = Counter("pagedserve_tenant_prompt_tokens", "Prompt tokens of admitted "
                                             "requests, by tenant.", t, **reg)
        self._tenant_generation_tokens = Counter("pagedserve_tenant_generation_tokens", "Tokens streamed to "
                                                 "clients, by tenant.", t, **reg)
        self._tenant_queue_time = Histogram("pagedserve_tenant_queue_time_seconds", "Let in at the gateway to the "
                                            "request's first output from the engine, by tenant: the wait in the "
                                            "replica's queue and the prefill.", t, buckets=LATENCY_BUCKETS, **reg)
        self.tenant_label = TenantLabels((), 0)
        self.configure_tenants([DEFAULT_TENANT.name], 0)
        if compat == "vllm":
            own = [self.finished, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.tpot,
                   self.e2e, self.prompt_len, self.generation_len, self.max_tokens]
            self.registry.register(VllmCompatCollector([f.collect for f in own] + [self.engines.collect]))
        # Every series at zero from the first scrape, so dashboards and alerts see 0, not "no data", until then.
        for protocol in PROTOCOLS:
            labels = (model_name, protocol)
            for reason in FINISH_REASONS:
                self.finished.labels(*labels, reason)
            for code in ERROR_CODES:
                self.errors.labels(*labels, code)
            for family in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.tpot, self.e2e,
                           self.prompt_len, self.generation_len, self.max_tokens):
                family.labels(*labels)

    def configure_tenants(self, fixed: Iterable[str], max_labels: int) -> None:
        """The tenants that always have their own label (each series at zero from now on) and how many others may
        (--tenant-metrics-max-labels)."""
        self.tenant_label = TenantLabels(fixed, max_labels)
        for name in self.tenant_label.fixed:
            self.tenant_requests(name)
            for reason in TENANT_LIMITS:
                self.tenant_rejected(name, reason)
            self.tenant_prompt_tokens(name)
            self.tenant_generation_tokens(name)
            self.tenant_queue_time(name)

    # The tenant series by label (``tenant_label`` of the tenant's name).
    def tenant_requests(self, label: str) -> Counter:
        return self._tenant_requests.labels(self.model_name, label)

    def tenant_rejected(self, label: str, reason: str) -> Counter:
        return self._tenant_rejected.labels(self.model_name, label, reason)

    def tenant_prompt_tokens(self, label: str) -> Counter:
        return self._tenant_prompt_tokens.labels(self.model_name, label)

    def tenant_generation_tokens(self, label: str) -> Counter:
        return self._tenant_generation_tokens.labels(self.model_name, label)

    def tenant_queue_time(self, label: str) -> Histogram:
        return self._tenant_queue_time.labels(self.model_name, label)

    def start_http_server(self, port: int, host: str = "0.0.0.0") -> int:
        app = make_wsgi_app(self.registry)

        def text_format(environ, start_response):
            # Always Prometheus's text format: prometheus_client's OpenMetrics output (what Prometheus asks for
            # first) writes sample names with label-name escaping, which turns every vllm:* series into vllm_*.
            environ.pop("HTTP_ACCEPT", None)
            return app(environ, start_response)

        self._http = make_server(host, port, text_format, _ThreadingWSGIServer, _QuietHandler)
        threading.Thread(target=self._http.serve_forever, name="metrics-http", daemon=True).start()
        return self._http.server_port

    def stop_http_server(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def request(self, protocol: str) -> RequestTimer:
        return RequestTimer(self, protocol)


class RequestTimer:
    """Times one generation request from the gateway's side."""

    def __init__(self, metrics: GatewayMetrics, protocol: str) -> None:
        self.m = metrics
        self.labels = (metrics.model_name, protocol)
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.num_tokens = 0
        # Bound once per request: these are updated for every streamed chunk.
        self._itl = metrics.itl.labels(*self.labels)
        self._generation_tokens = metrics.generation_tokens.labels(*self.labels)
        self._tenant_generation_tokens: Counter | None = None
        self._tenant_prompt_tokens: Counter | None = None

    def tenant(self, label: str) -> None:
        """Count the request's tokens under its tenant's label too."""
        self._tenant_prompt_tokens = self.m.tenant_prompt_tokens(label)
        self._tenant_generation_tokens = self.m.tenant_generation_tokens(label)

    def admitted(self, prompt_tokens: int, max_tokens: int) -> None:
        self.m.prompt_tokens.labels(*self.labels).inc(prompt_tokens)
        if self._tenant_prompt_tokens is not None:
            self._tenant_prompt_tokens.inc(prompt_tokens)
        self.m.prompt_len.labels(*self.labels).observe(prompt_tokens)
        self.m.max_tokens.labels(*self.labels).observe(max_tokens)

    def tokens(self, n: int) -> None:
        if n == 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.m.ttft.labels(*self.labels).observe(now - self.start)
        else:
            self._itl.observe(now - self.last)
        self.last = now
        self.num_tokens += n
        self._generation_tokens.inc(n)
        if self._tenant_generation_tokens is not None:
            self._tenant_generation_tokens.inc(n)

    def finished(self, reason: str) -> None:
        self.m.finished.labels(*self.labels, reason).inc()
        if reason in ("stop", "length"):
            now = time.monotonic()
            self.m.e2e.labels(*self.labels).observe(now - self.start)
            self.m.generation_len.labels(*self.labels).observe(self.num_tokens)
            if self.num_tokens > 1 and self.first is not None:
                self.m.tpot.labels(*self.labels).observe((self.last - self.first) / (self.num_tokens - 1))

    def error(self, code: str) -> None:
        self.m.errors.labels(*self.labels, code).inc()
