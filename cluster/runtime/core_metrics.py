"""Metrics measured inside an engine-core actor. The gateway's /metrics pulls them at scrape time (one Ray call per
replica), labels them with ``replica`` and ``model_name``, and serves them with its own in one scrape."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedserve.cluster.shared import LATENCY_BUCKETS, STEP_BUCKETS, TOKEN_BUCKETS
from pagedserve.engine.engine_core import EngineCore, StepStats
from pagedserve.scheduler.request import Request

disable_created_metrics()  # no *_created series: they only clutter scrapes and dashboards

# Engine-core phases (StepStats) and, on rank 0, the model runner's (ModelRunnerOutput.timings).
STEP_PHASES = ("schedule", "execute", "update", "prepare", "forward", "sample")


class EngineCoreMetrics:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.registry = CollectorRegistry(auto_describe=True)
        h = dict(registry=self.registry)
        self.queue_time = Histogram("pagedserve_request_queue_time_seconds",
                                    "Time from arrival at the scheduler to the first scheduled step.",
                                    buckets=LATENCY_BUCKETS, **h)
        self.prefill_time = Histogram("pagedserve_request_prefill_time_seconds",
                                      "Time from the first scheduled step to the first output token.",
                                      buckets=LATENCY_BUCKETS, **h)
        self.decode_time = Histogram("pagedserve_request_decode_time_seconds",
                                     "Time from the first output token to the end of the request.",
                                     buckets=LATENCY_BUCKETS, **h)
        self.iteration_tokens = Histogram("pagedserve_iteration_tokens", "Tokens scheduled per engine step.",
                                          buckets=TOKEN_BUCKETS, **h)
        self.step_time = Histogram("pagedserve_step_duration_seconds",
                                   "Engine step time by phase: schedule, execute (broadcast + workers), prepare, "
                                   "forward and sample (on rank 0), update.", ["phase"],
                                   buckets=STEP_BUCKETS, **h)
        self.grammar_compile_time = Histogram(
            "pagedserve_structured_output_compile_time_seconds",
            "Time to compile a structured-output grammar (once per distinct constraint; later uses hit the cache).",
            buckets=LATENCY_BUCKETS, **h)
        for phase in STEP_PHASES:  # at zero from the first scrape, not only after the first step
            self.step_time.labels(phase)
        self._tracked: dict[str, tuple[Request, list[float | None]]] = {}  # id -> (request, [first token time])

    def track(self, req: Request) -> None:
        self._tracked[req.request_id] = (req, [None])

    def on_step(self, outputs, step: StepStats | None) -> None:
        now = time.monotonic()
        for out in outputs:
            entry = self._tracked.get(out.request_id)
            if entry is not None and out.new_token_ids and entry[1][0] is None:
                entry[1][0] = now
        for seconds in self.core.scheduler.structured.take_compile_seconds():
            self.grammar_compile_time.observe(seconds)
        if step is not None:
            self.iteration_tokens.observe(step.num_tokens)
            for phase, seconds in [("schedule", step.schedule), ("execute", step.execute),
                                   ("update", step.update), *step.worker.items()]:
                self.step_time.labels(phase).observe(seconds)
        self.reap(now)

    def reap(self, now: float | None = None) -> None:
        """Observe the per-request times of requests that ended (by output, stop string or abort)."""
        now = now or time.monotonic()
        for rid, (req, first) in list(self._tracked.items()):
            if not req.finished:
                continue
            del self._tracked[rid]
            if req.first_scheduled_time is None:
                continue
            self.queue_time.observe(req.first_scheduled_time - req.arrival_time)
            if first[0] is not None:
                self.prefill_time.observe(first[0] - req.first_scheduled_time)
                self.decode_time.observe(now - first[0])

    def collect(self) -> list[Metric]:
        s = self.core.get_stats()
        st = s.scheduler
        cc = self.core.config.cache_config
        fams: list[Metric] = []

        def gauge(name: str, doc: str, value: float) -> None:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            fams.append(g)

        def counter(name: str, doc: str, value: float, label: str | None = None, values: dict | None = None):
            c = CounterMetricFamily(name, doc, labels=[label] if label else None)
            for k, v in (values or {None: value}).items():
                c.add_metric([k] if label else [], v)
            fams.append(c)

        gauge("pagedserve_num_requests_running", "Requests in the running batch.", s.num_running)
        gauge("pagedserve_num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        gauge("pagedserve_num_requests_swapped", "Requests preempted to CPU swap space.", s.num_swapped)
        gauge("pagedserve_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1).", s.kv_usage)
        gauge("pagedserve_kv_cache_num_blocks", "KV cache blocks per worker (each rank holds its heads' share).",
              s.kv_blocks_total)
        gauge("pagedserve_kv_cache_free_blocks", "KV cache blocks free or holding only evictable cached prefixes.",
              s.kv_blocks_free)
        gauge("pagedserve_kv_leases", "Prompts whose KV blocks this prefill replica holds for a decode replica's "
              "pull.", s.num_kv_leases)
        counter("pagedserve_kv_leases_expired", "KV leases that ran out (--kv-lease-timeout) before the decode "
                "replica's pull acknowledged them; it computes what it did not get.", s.num_kv_leases_expired)
        info = GaugeMetricFamily("pagedserve_cache_config_info", "KV cache configuration (value is always 1).",
                                 labels=["block_size", "num_blocks", "num_cpu_blocks", "tensor_parallel_size",
                                         "enable_prefix_caching"])
        info.add_metric([str(cc.block_size), str(cc.num_blocks), str(cc.num_cpu_blocks),
                         str(self.core.config.parallel_config.tensor_parallel_size),
                         str(cc.enable_prefix_caching).lower()], 1)
        fams.append(info)
        counter("pagedserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                st.prefix_cache_queries)
        counter("pagedserve_prefix_cache_hits", "Prompt tokens served from the prefix cache.", st.prefix_cache_hits)
        counter("pagedserve_num_preemptions", "Requests preempted, by mode.", 0, "mode",
                dict(st.num_preemptions))
        counter("pagedserve_swapped_blocks", "KV blocks copied between GPU and CPU swap space.", 0, "direction",
                {"out": st.num_swapped_out_blocks, "in": st.num_swapped_in_blocks})
        counter("pagedserve_copy_on_write_blocks", "KV blocks copied on write (a shared block diverged).",
                s.copy_on_write)
        counter("pagedserve_engine_steps", "Engine steps (iterations) run.", st.num_steps)
        counter("pagedserve_scheduled_tokens", "Tokens scheduled for the model (prefill + decode).",
                st.num_scheduled_tokens)
        counter("pagedserve_worker_restarts", "Times the tensor-parallel worker group was rebuilt after a failure.",
                s.num_worker_restarts)
        counter("pagedserve_structured_output_requests", "Requests constrained by structured output.",
                s.num_constrained_requests)
        counter("pagedserve_spec_decode_num_drafts", "Draft sequences proposed by speculative decoding.",
                st.spec_num_drafts)
        counter("pagedserve_spec_decode_num_draft_tokens", "Draft tokens proposed.", st.spec_num_draft_tokens)
        counter("pagedserve_spec_decode_num_accepted_tokens", "Draft tokens accepted.", st.spec_num_accepted_tokens)
        per_pos = st.spec_accepted_per_pos or [0]  # a zero series from the first scrape
        counter("pagedserve_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position.",
                0, "position", {str(i): v for i, v in enumerate(per_pos)})
        return fams + list(self.registry.collect())
