"""``EngineClient``: what a server protocol (gRPC, HTTP) needs from the engine, wherever the engine runs. The
server room codes against this; the serving runtime's router over Ray replicas implements it."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable

from prometheus_client.core import Metric

from pagedserve.common.outputs import BeamSearchOutput, RequestOutput
from pagedserve.common.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.engine.core_types import EngineCoreRequest, EngineInfo, EngineStats, ScaleResult
from pagedserve.engine.input_processor import PromptType
from pagedserve.scheduler.request import DEFAULT_TENANT, Tenant


class EngineClient(ABC):
    info: EngineInfo  # of the engine (for several replicas: the smallest KV pool)

    @property
    @abstractmethod
    def healthy(self) -> bool:
        """Whether it can take and finish requests now (not while every replica is down or restarting)."""

    @property
    def num_replicas(self) -> int:
        """Replicas serving now (scaling and failures change it)."""
        return 1

    @property
    def health_detail(self) -> str:
        """Why it cannot serve, when it cannot (a failed model's error); health checks report it."""
        return ""

    @abstractmethod
    def add_health_listener(self, listener: Callable[[], Awaitable[None]]) -> None:
        """Awaited on the event loop whenever ``healthy`` may have changed."""

    @abstractmethod
    async def process(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams | None,
                      cache_salt: str | None = None, priority: int = 0, tenant: Tenant = DEFAULT_TENANT
                      ) -> tuple[str | None, EngineCoreRequest]:
        """Tokenize and validate (the one intake path); raises InvalidRequestError naming the field. ``priority``
        and ``tenant`` go with the request into the replica's scheduler."""

    @abstractmethod
    def generate(self, prompt: str | None, request: EngineCoreRequest, stream: bool = True,
                 session_id: str | None = None, on_first_output: Callable[[], None] | None = None
                 ) -> AsyncIterator[RequestOutput | BeamSearchOutput]:
        """Run a processed request: its delta outputs (every step's when ``stream``, else the final one). Raises
        OverloadedError or EngineUnavailableError; closing the iterator early aborts the request. ``session_id``
        (the client's, if any) keeps a session's requests on one replica where that helps. ``on_first_output`` is
        called once, on the event loop, when the engine's first output for the request arrives (its first token,
        streamed or not; beam search: its result): the end of its wait and its prefill. It must not raise."""

    @abstractmethod
    async def abort(self, request_id: str) -> bool:
        """End a running request (its stream ends with finish reason "abort"); False if it is not running."""

    @abstractmethod
    async def get_stats(self) -> list[EngineStats]:
        """One per live replica."""

    @abstractmethod
    def collect_metrics(self) -> list[Metric]:
        """The engines' Prometheus metric families, for the server's /metrics (called off the event loop, into a
        snapshot that scrapes read)."""


class ReplicaScaler(ABC):
    """Changes the number of replicas while they serve (the process that launched them owns it)."""

    @property
    @abstractmethod
    def is_scaling(self) -> bool:
        """A change is in progress."""

    @abstractmethod
    async def scale_to(self, num_replicas: int, drain_timeout: float | None = None,
                       pool: str | None = None) -> ScaleResult:
        """Add replicas (placed and warmed up before any request is routed to them) or remove the least busy
        (routed nothing new, their requests given ``drain_timeout`` seconds to finish, the rest moved to the
        others token-exact). ``pool``: with disaggregated prefill and decode, "prefill" or "decode" (the default:
        the replicas that decode); the prefill pool may go to 0 (every request then runs whole on the decode pool).
        Raises InvalidRequestError for a bad count or pool, or while another change runs."""

    @abstractmethod
    async def rollout(self, model: str, drain_timeout: float | None = None) -> ScaleResult:
        """Replace every replica, one at a time, by one serving ``model`` (same architecture and tokenizer; the
        served name stays). A replacement that cannot be placed or fails its warm-up stops the rollout with the
        replicas not yet replaced still serving (EngineUnavailableError saying why)."""
