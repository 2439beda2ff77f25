"""Errors that cross layers. Each is raised in one layer and caught by type in another (never by name or message),
and each maps to one client-facing status: the gRPC code and the HTTP status of the server room."""
from __future__ import annotations


class PagedServeError(Exception):
    """Base of the errors below."""


class InvalidRequestError(PagedServeError, ValueError):
    """A request that can never run as sent: bad parameters, a prompt that does not fit. Nothing was allocated.
    A ``ValueError`` too, as vLLM raises for bad sampling parameters."""


class DuplicateRequestError(InvalidRequestError):
    """A request id that already runs on this engine (a resume that reached it twice finds it there)."""


class OverloadedError(PagedServeError):
    """The server is at a limit it was given (``--max-concurrent-requests`` at the gateway,
    ``--max-waiting-requests`` at a replica): retry later."""


class EngineUnavailableError(PagedServeError):
    """No engine can take or finish the request now: loading, draining, or its replica failed."""


class ReplicaDrainingError(EngineUnavailableError):
    """The replica is draining (a scale-in or a rollout) and takes no new request: the gateway, which routed it there
    before it heard of the drain, sends it to another replica."""


class WorkerFailedError(PagedServeError):
    """A tensor-parallel worker died; the whole group is unusable until rebuilt."""


class KVTransferError(PagedServeError):
    """A KV handoff between replicas could not move the blocks (the producer lost them or is gone, the executor
    cannot read them): the consumer computes them itself instead."""
