"""Operator routes: change the number of replicas while serving (vLLM's ``/scale_elastic_ep`` name and body), and
roll the replicas over to another model dir (``/rollout``)."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field

from pagedserve.cluster.server.openai.errors import OpenAIError
from pagedserve.cluster.server.openai.protocol import RequestModel, error_statuses
from pagedserve.cluster.server.state import ServingState
from pagedserve.engine.protocol import ReplicaScaler
from pagedserve.errors import EngineUnavailableError, InvalidRequestError


class ScaleRequest(RequestModel):
    new_data_parallel_size: int = Field(description="the number of replicas to serve with")
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


def add_admin_routes(app: FastAPI, state: ServingState, deps: list[Any], auth: tuple[int, ...]) -> None:
    @app.post("/scale_elastic_ep", dependencies=deps, response_model=ScaleResponse,
              responses=error_statuses(400, *auth, 503))
    async def scale_elastic_ep(body: ScaleRequest) -> ScaleResponse:
        # Shielded: a client that hangs up must not leave a replica half drained.
        task = asyncio.ensure_future(_scaler(state).scale_to(body.new_data_parallel_size, body.drain_timeout))
        try:
            result = await asyncio.shield(task)
        except InvalidRequestError as e:
            raise OpenAIError(400, str(e), "new_data_parallel_size") from None
        # A replica that cannot be placed, fails its preflight (ValueError) or its warm-up.
        except (EngineUnavailableError, RuntimeError, ValueError) as e:
            raise OpenAIError(503, f"scaling stopped: {e}") from None
        return ScaleResponse(message=f"scaled to {result.num_replicas} replicas", **dataclasses.asdict(result))

    @app.post("/rollout", dependencies=deps, response_model=ScaleResponse, responses=error_statuses(400, *auth, 503))
    async def rollout(body: RolloutRequest) -> ScaleResponse:
        scaler = _scaler(state)
        task = asyncio.ensure_future(scaler.rollout(body.model, body.drain_timeout))
        try:
            result = await asyncio.shield(task)
        except InvalidRequestError as e:
            raise OpenAIError(400, str(e), "model") from None
        except (EngineUnavailableError, RuntimeError, ValueError) as e:
            raise OpenAIError(503, f"rollout stopped, the replicas not yet replaced still serve: {e}") from None
        return ScaleResponse(message=f"{result.num_replicas} replicas serve {result.model}",
                             **dataclasses.asdict(result))

    @app.api_route("/is_scaling_elastic_ep", methods=["GET", "POST"], dependencies=deps,
                   response_model=ScalingStatus, responses=error_statuses(*auth))
    async def is_scaling_elastic_ep() -> ScalingStatus:
        return ScalingStatus(is_scaling_elastic_ep=state.scaler is not None and state.scaler.is_scaling)
