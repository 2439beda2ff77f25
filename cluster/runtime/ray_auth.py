"""Refuse to join a Ray cluster that anyone on the network could use.

A Ray cluster with token authentication off runs whatever code any client that reaches its ports submits. Serving
from one is safe only where nothing beyond this host can reach it (a GCS on loopback); otherwise ``serve`` and
``gateway`` refuse unless the operator says ``--allow-unauthenticated-ray`` (a private network they trust), and then
warn on every start.
"""
from __future__ import annotations

import logging

import ray
from ray._private.authentication.authentication_utils import is_token_auth_enabled

from pagedserve.cluster.shared import is_loopback

logger = logging.getLogger(__name__)

ALLOW_FLAG = "--allow-unauthenticated-ray"


def unauthenticated_exposure(gcs_address: str, token_auth: bool) -> str | None:
    """What is wrong with serving from the Ray cluster at ``gcs_address`` (host:port), or None."""
    if token_auth or is_loopback(gcs_address.rsplit(":", 1)[0].strip("[]")):
        return None
    return (f"the Ray cluster at {gcs_address} has token authentication off, so anyone who can reach it can run code "
            "on every node; start it with RAY_AUTH_MODE=token (KubeRay: authOptions mode token), or pass "
            f"{ALLOW_FLAG} if only trusted hosts can reach it")


def check_ray_auth(allow_unauthenticated: bool) -> None:
    """After joining a cluster: raise ValueError (or, when allowed, warn) if it is exposed without authentication."""
    problem = unauthenticated_exposure(ray.get_runtime_context().gcs_address, is_token_auth_enabled())
    if problem is None:
        return
    if not allow_unauthenticated:
        raise ValueError(problem)
    logger.warning("SECURITY: %s (continuing: %s given)", problem.split(";")[0], ALLOW_FLAG)
