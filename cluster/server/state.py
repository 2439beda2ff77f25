"""What every protocol's server shares: the engine once it is ready, the served model, the tokenizer, the API keys
and tenants, and the admission of requests (refused while loading or draining, counted so that a drain can wait for
them)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pagedserve.cluster.server.api_keys import KeyTable
from pagedserve.cluster.server.api_options import ApiOptions
from pagedserve.cluster.server.metrics import GatewayMetrics
from pagedserve.cluster.server.request_owners import RequestOwners
from pagedserve.cluster.server.tenants import TenancyOptions, Tenants
from pagedserve.common.errors import EngineUnavailableError, InvalidRequestError, OverloadedError
from pagedserve.engine.core_types import EngineInfo
from pagedserve.engine.protocol import EngineClient, ReplicaScaler

logger = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    name: str  # --served-model-name, else the model dir's name
    info: EngineInfo
    data_parallel_size: int


# Tokenize and detokenize work before the model is up; until then these bound them (its own limits come with it).
LOADING_MAX_PROMPT_BYTES = 1 << 20
LOADING_MAX_TOKEN_IDS = 1 << 16
# An HTTP body holds a prompt of up to max_prompt_bytes, JSON-escaped (at worst 6 bytes a byte: "\u0001"), and the
# other fields (tools, up to 1 MiB; a JSON schema; logit_bias; ...) within the headroom. A batch of prompts must fit
# the same bound.
BODY_BYTES_PER_PROMPT_BYTE = 6
BODY_HEADROOM_BYTES = 2 << 20
# What a refusal at a limit (HTTP 429's Retry-After header, RESOURCE_EXHAUSTED's retry-after metadata) tells the
# client to wait, in seconds.
RETRY_AFTER_S = 1


class ServingState:
    """``max_concurrent_requests``: generation requests in flight at once, over all protocols; one more is refused
    at once with OverloadedError (gRPC RESOURCE_EXHAUSTED, HTTP 429). ``keys``: the API keys both protocols accept
    (none: no key needed); ``tenancy``: the tenants, their limits and the header that may name them."""

    def __init__(self, tokenizer, metrics: GatewayMetrics, max_concurrent_requests: int,
                 options: ApiOptions = ApiOptions(), keys: KeyTable = KeyTable(),
                 tenancy: TenancyOptions = TenancyOptions()) -> None:
        self.tokenizer = tokenizer
        self.options = options
        self.metrics = metrics
        self.keys = keys
        self.tenants = Tenants(tenancy, metrics)
        self.max_concurrent_requests = max_concurrent_requests
        self.engine: EngineClient | None = None  # set once the replicas are up
        self.model: ModelInfo | None = None
        self.scaler: ReplicaScaler | None = None  # changes the number of replicas (where this process owns them)
        self.draining = False
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.owners = RequestOwners()
        # Called with the new serving status whenever it changes (the gRPC health service listens).
        self.listeners: list[Callable[[bool], Awaitable[None]]] = []
        self._logged_serving = False

    @property
    def serving(self) -> bool:
        """Loaded, not draining, and the engine can take requests: what health checks report."""
        return self.engine is not None and not self.draining and self.engine.healthy

    @property
    def not_serving_reason(self) -> str:
        """Why health says NOT_SERVING ("" while serving)."""
        if self.draining:
            return "draining"
        if self.engine is None:
            return "loading"
        if not self.engine.healthy:
            return f"no model replica can take requests: {self.engine.health_detail}"
        return ""

    async def _notify(self) -> None:
        if self.serving != self._logged_serving and self.engine is not None:
            self._logged_serving = self.serving
            if self.serving:
                logger.info("health: SERVING")
            else:
                logger.log(logging.INFO if self.draining else logging.ERROR, "health: NOT_SERVING (%s)",
                           self.not_serving_reason)
        for listener in self.listeners:
            await listener(self.serving)

    async def set_ready(self, engine: EngineClient, model: ModelInfo) -> None:
        self.engine, self.model = engine, model
        engine.add_health_listener(self._notify)
        await self._notify()

    async def start_draining(self) -> None:
        self.draining = True
        await self._notify()

    def tenant_of(self, key_index: int | None, header_value: str | None) -> str:
        """The tenant of a generation request made with the key at ``key_index`` (None: no key) and, in case the
        operator named a tenant header, that header's value; raises InvalidRequestError for a bad value."""
        return self.tenants.resolve(self.keys.tenant(key_index), header_value if self.tenants.header else None)

    def ready_engine(self) -> EngineClient:
        """The engine, or EngineUnavailableError saying why requests are refused now."""
        if self.draining:
            raise EngineUnavailableError("the server is shutting down")
        if self.engine is None:
            raise EngineUnavailableError("the model is still loading")
        return self.engine

    @property
    def max_prompt_bytes(self) -> int:
        return self.model.info.limits.max_prompt_bytes if self.model is not None else LOADING_MAX_PROMPT_BYTES

    @property
    def max_body_bytes(self) -> int:
        """The largest HTTP request body (413 beyond it): derived from max_prompt_bytes (--max-prompt-bytes)."""
        return BODY_BYTES_PER_PROMPT_BYTE * self.max_prompt_bytes + BODY_HEADROOM_BYTES

    @property
    def max_token_ids(self) -> int:
        """The most token ids a detokenize call takes: a sequence's worth."""
        return self.model.info.max_model_len if self.model is not None else LOADING_MAX_TOKEN_IDS

    @contextmanager
    def request_slot(self, weight: int = 1) -> Iterator[None]:
        """Held for the whole of one generation request, so that a drain waits for it. ``weight``: the engine
        sequences it runs (an HTTP batch of P prompts with n samples each takes P x n)."""
        if weight > self.max_concurrent_requests:  # it could never run: not a retry-later
            raise InvalidRequestError(f"n: this request runs {weight} sequences (prompts x n), more than the "
                                      f"server's limit of {self.max_concurrent_requests} (--max-concurrent-requests)")
        if self.in_flight + weight > self.max_concurrent_requests:
            raise OverloadedError(f"the server is at its limit of {self.max_concurrent_requests} concurrent requests "
                                  "(--max-concurrent-requests); retry later")
        self.in_flight += weight
        self.idle.clear()
        try:
            yield
        finally:
            self.in_flight -= weight
            if self.in_flight == 0:
                self.idle.set()
