"""Operator routes: change the number of replicas while serving (vLLM's ``/scale_elastic_ep`` name and body), and
roll the replicas over to another model dir (``/rollout``)."""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, Field

from pagedserve.cluster.server.openai.errors import OpenAIError
from pagedserve.cluster.server.openai.protocol import RequestModel, error_statuses
from pagedserve.cluster.server.state import ServingState
from pagedserve.common.errors import EngineUnavailableError, InvalidRequestError
from pagedserve.engine.core_types import ScaleResult
from pagedserve.engine.protocol import ReplicaScaler


class ScaleRequest(RequestModel):
    new_data_parallel_size: int = Field(description="the number of replicas to serve with (in the pool named)")
    pool: Literal["prefill", "decode"] | None = Field(None, description="with disaggregated prefill and decode: the "
                                                                        "pool to scale (default: decode)")
    drain_timeout: float | None = Field(None, ge=0, description="seconds a removed replica's requests get to finish "
                                                                "before they move to another (default: the server's "
                                                                "--drain-timeout)")


class RolloutRequest(RequestModel):
    model: str = Field(max_length=4096, description="the model dir the new replicas load, as the server sees it")
    drain_timeout: float | None = Field(None, ge=0, description="seconds each replaced replica's requests get to "
                                                                "finish before they move to another")


class ScaleResponse(BaseModel):
    message: str
    num_replicas: int
    added: int
    removed: int
    moved_requests: int
    model: str | None = None


class ScalingStatus(BaseModel):
    is_scaling_elastic_ep: bool


def _scaler(state: ServingState) -> ReplicaScaler:
    if state.engine is None:
        raise OpenAIError(503, "the model is still loading")
    if state.scaler is None:
        raise OpenAIError(400, "this server does not own its replicas: change them through the `pagedserve serve` "
                               "process that launched them")
    return state.scaler


async def _change(change: Awaitable[ScaleResult], param: str, stopped: str) -> ScaleResult:
    """Run a change of the replicas to its end, shielded: a client that hangs up must not leave a replica half
    drained."""
    try:
        return await asyncio.shield(asyncio.ensure_future(change))
    except InvalidRequestError as e:
        raise OpenAIError(400, str(e), param) from None
    # A replica that cannot be placed, fails its preflight (ValueError) or its warm-up.
    except (EngineUnavailableError, RuntimeError, ValueError) as e:
        raise OpenAIError(503, f"{stopped}: {e}") from None


def add_admin_routes(app: FastAPI, state: ServingState, deps: list[Any], auth: tuple[int, ...]) -> None:
    @app.post("/scale_elastic_ep", dependencies=deps, response_model=ScaleResponse,
              responses=error_statuses(400, *auth, 503))
    async def scale_elastic_ep(body: ScaleRequest) -> ScaleResponse:
        result = await _change(_scaler(state).scale_to(body.new_data_parallel_size, body.drain_timeout, body.pool),
                               "new_data_parallel_size", "scaling stopped")
        return ScaleResponse(message=f"scaled to {result.num_replicas} replicas", **dataclasses.asdict(result))

    @app.post("/rollout", dependencies=deps, response_model=ScaleResponse, responses=error_statuses(400, *auth, 503))
    async def rollout(body: RolloutRequest) -> ScaleResponse:
        result = await _change(_scaler(state).rollout(body.model, body.drain_timeout), "model",
                               "rollout stopped, the replicas not yet replaced still serve")
        return ScaleResponse(message=f"{result.num_replicas} replicas serve {result.model}",
                             **dataclasses.asdict(result))

    async def is_scaling_elastic_ep() -> ScalingStatus:
        return ScalingStatus(is_scaling_elastic_ep=state.scaler is not None and state.scaler.is_scaling)

    for method in ("GET", "POST"):  # one route each: one OpenAPI operation id each
        app.add_api_route("/is_scaling_elastic_ep", is_scaling_elastic_ep, methods=[method], dependencies=deps,
                          response_model=ScalingStatus, responses=error_statuses(*auth),
                          operation_id=f"is_scaling_elastic_ep_{method.lower()}")
