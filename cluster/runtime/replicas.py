"""Start the model replicas of a serving cluster: per replica one placement group (STRICT_PACK, so a replica never
spans nodes) holding its engine-core actor and, with tensor parallelism, one bundle per TP rank.

Replicas launched with a ``name`` are detached named actors in the ``NAMESPACE`` Ray namespace, called
``<name>-replica-<i>``: they outlive the gateway that launched them, and more gateways attach to them by name
(``attach_replicas``), each with its own output stream from every replica."""
from __future__ import annotations

import enum
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedserve.cluster.runtime.engine_core_actor import EngineCoreActor
from pagedserve.cluster.runtime.preflight import (
    NodeReport,
    PreflightFailed,
    check_placement_group,
    checks_in_engine_actor,
    local_versions,
)
from pagedserve.common.errors import EngineUnavailableError
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.executor.ray_utils import (
    HELD_CHECK_S,
    ensure_ray,
    make_placement_group,
    rank_bundle,
    rank_cpus,
)

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3  # of a dead engine-core actor, killed or ended itself (``ActorExit``), by Ray
CORE_ACTOR_CPUS = 0.05  # the engine-core actor of a TP group; its ranks hold the real CPUs
NAMESPACE = "pagedserve"
_NAME = re.compile(r"^(?P<model>.+)-replica-(?P<index>\d+)$")


class ReplicaRole(str, enum.Enum):
    """What a replica runs: whole requests (the aggregated mode), or one phase of a disaggregated request."""

    BOTH = "both"
    PREFILL = "prefill"  # a prompt's KV and first token, handed to a decode replica
    DECODE = "decode"  # the rest, and every request not worth handing off


@dataclass(eq=False)
class Replica:
    """A model replica: what launching it made (the scaler's), and its state as this process's router sees it."""

    index: int
    actor: ray.actor.ActorHandle
    placement_group: object = None  # None for a replica this process attached to (its launcher owns it)
    load: int = 0  # running requests, from this gateway
    work: int = 0  # their tokens still to prefill and (estimated) to generate (see ``routing``)
    cached: set[bytes] = field(default_factory=set)  # block hashes in its prefix cache, from its KV events
    alive: bool = True  # its actor is up
    ready: bool = True  # and not rebuilding its workers
    gone: bool = False  # dead for good (Ray's restarts spent)
    error: str | None = None  # failed for good: its model fails every step the same way (the error)
    retiring: bool = False  # draining for a scale-in or a replacement; dropped from the list once its actor ends
    restarts: int = 0  # times this gateway saw its actor come back
    role: ReplicaRole = ReplicaRole.BOTH

    @property
    def serving(self) -> bool:
        return self.alive and self.ready and self.error is None

    @property
    def out(self) -> bool:
        """It will not serve again without an operator (restart the server once the model is fixed)."""
        return self.gone or self.error is not None

    @property
    def condition(self) -> str:
        """Why it does not serve."""
        return (f"failed: {self.error}" if self.error is not None else "gone" if self.gone
                else "restarting" if not self.alive else "rebuilding its workers")


def health_detail(replicas: list[Replica]) -> str:
    """Why no replica serves (each one's condition, with the error of one whose model failed); "" while one does."""
    if any(r.serving for r in replicas):
        return ""
    return "; ".join(f"replica {r.index} {r.condition}" for r in replicas)


def replica_name(model_name: str, index: int) -> str:
    return f"{model_name}-replica-{index}"


def launch_replicas(args: EngineArgs, data_parallel_size: int = 1, max_waiting_requests: int | None = None,
                    step_timeout: float | None = None, name: str | None = None,
                    roles: list[ReplicaRole] | None = None) -> list[Replica]:
    """Start ``data_parallel_size`` replicas and warm them up; raises if they cannot be placed or loaded, or if a
    replica's model fails its warm-up request (``EngineUnavailableError`` with the model's error). ``name``: the
    served model's name, making the replicas detached named actors (see the module's doc). ``roles``: each
    replica's (default: every one runs whole requests)."""
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}")
    roles = roles or [ReplicaRole.BOTH] * data_parallel_size
    config = args.create_engine_config()  # validates the model dir and the TP split before any actor starts
    ensure_ray(args.ray_address)
    if name is not None:
        if attach_replicas(name):
            raise ValueError(f"replicas of {name!r} already run in this Ray cluster (namespace {NAMESPACE!r}); stop "
                             "that server, or pick another --served-model-name")
    # Placed together: a placement group may wait seconds for room, a GPU node check takes a fresh Ray worker.
    with ThreadPoolExecutor(min(data_parallel_size, 16)) as pool:
        started = [pool.submit(_start_replica, args, config, i, data_parallel_size, max_waiting_requests,
                               step_timeout, name, role=roles[i]) for i in range(data_parallel_size)]
    replicas = [f.result() for f in started if f.exception() is None]
    failed = [f.exception() for f in started if f.exception() is not None]
    try:
        if failed:
            raise failed[0]
        _warm_up(replicas)
    except BaseException:
        shutdown_replicas(replicas)
        raise
    logger.info("%d replica(s) ready (tensor_parallel_size=%d)", len(replicas),
                config.parallel_config.tensor_parallel_size)
    return replicas


def launch_replica(args: EngineArgs, index: int, share: int, max_waiting_requests: int | None = None,
                   step_timeout: float | None = None, name: str | None = None,
                   held_wait_s: float | None = HELD_CHECK_S, role: ReplicaRole = ReplicaRole.BOTH) -> Replica:
    """One more replica (a scale-out, or a rollout's replacement), warmed up, with a CPU share sized for ``share``
    replicas; released again if it cannot be placed or fails its warm-up. ``held_wait_s``: see
    ``make_placement_group``."""
    replica = _start_replica(args, args.create_engine_config(), index, share, max_waiting_requests, step_timeout,
                             name, held_wait_s, role)
    try:
        _warm_up([replica])
    except BaseException:
        shutdown_replicas([replica])
        raise
    return replica


def _start_replica(args: EngineArgs, config, index: int, share: int, max_waiting_requests: int | None,
                   step_timeout: float | None, name: str | None, held_wait_s: float | None = HELD_CHECK_S,
                   role: ReplicaRole = ReplicaRole.BOTH) -> Replica:
    """Place replica ``index`` and start its engine-core actor (not yet warmed up); ``share``: how many replicas
    divide the cluster's CPUs."""
    tp = config.parallel_config.tensor_parallel_size
    gpu = config.device == "cuda"
    if config.parallel_config.distributed_executor_backend == "uni":  # the model runs inside the engine-core actor
        cpu = rank_cpus(share, gpu)
        bundles = [rank_bundle(cpu, gpu)]
        opts = {"num_cpus": cpu, "num_gpus": 1 if gpu else 0}
        threads = max(1, (os.cpu_count() or 1) // share)
    else:
        cpu = rank_cpus(tp * share, gpu, CORE_ACTOR_CPUS * share)
        bundles = [{"CPU": CORE_ACTOR_CPUS}] + [rank_bundle(cpu, gpu)] * tp
        opts = {"num_cpus": CORE_ACTOR_CPUS}
        threads = 1
    pg = make_placement_group(bundles, f"replica{index}", detached=name is not None,
                              held_wait_s=held_wait_s)
    # The node's checks run before the engine loads (fail in seconds, with the fixes), in the engine-core actor
    # where they can (see ``_warm_up``).
    in_actor = checks_in_engine_actor(config)
    if not in_actor and not (report := check_placement_group(pg, config)).ok:
        remove_placement_group(pg)
        raise _preflight_error(index, report)
    named = {} if name is None else {"name": replica_name(name, index), "namespace": NAMESPACE,
                                     "lifetime": "detached"}
    try:
        actor = ray.remote(EngineCoreActor).options(
            **named,
            # Ray restarts a dead engine-core actor (its TP workers die with it; the new one rebuilds them).
            **opts, max_concurrency=10_000, max_restarts=MAX_RESTARTS,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                 placement_group_bundle_index=0,
                                                                 placement_group_capture_child_tasks=False),
        ).remote(args, max_waiting_requests, threads, step_timeout,
                 preflight_versions=local_versions() if in_actor else None, role=role.value)
    except BaseException:
        remove_placement_group(pg)
        raise
    return Replica(index, actor, pg, role=role)


def find_served_model(model_name: str | None = None) -> str | None:
    """``model_name`` if named replicas of it run in this Ray cluster, else None; ``model_name`` None: the one model
    they serve (ValueError if they serve several)."""
    found = {m["model"] for e in ray.util.list_named_actors(all_namespaces=True)
             if e["namespace"] == NAMESPACE and (m := _NAME.match(e["name"])) is not None}
    if model_name is not None:
        return model_name if model_name in found else None
    if len(found) > 1:
        raise ValueError(f"this Ray cluster serves several models ({', '.join(sorted(found))}); name one with "
                         "--served-model-name")
    return next(iter(found), None)


def attach_replicas(model_name: str) -> list[Replica]:
    """The named replicas of ``model_name`` running in this Ray cluster, in index order ([] if none)."""
    indices = sorted(int(m["index"]) for e in ray.util.list_named_actors(all_namespaces=True)
                     if e["namespace"] == NAMESPACE and (m := _NAME.match(e["name"])) is not None
                     and m["model"] == model_name)
    actors = [ray.get_actor(replica_name(model_name, i), namespace=NAMESPACE) for i in indices]
    roles = ray.get([a.get_role.remote() for a in actors])
    return [Replica(i, a, None, role=ReplicaRole(role)) for i, a, role in zip(indices, actors, roles)]


def _warm_up(replicas: list[Replica]) -> None:
    """Each replica runs a request through its model (prefill and decode) before any is routed to: a model that
    cannot run fails the launch, naming the replica and the model's error (replicas share model and arguments, so
    one that fails here is a deployment to fix, not one to serve at reduced capacity)."""
    refs = [r.actor.warmup.remote() for r in replicas]
    for r, ref in zip(replicas, refs):
        try:
            ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else e
            if isinstance(cause, PreflightFailed):
                raise _preflight_error(r.index, cause.report) from None
            why = str(cause) if isinstance(cause, EngineUnavailableError) else f"{type(cause).__name__}: {cause}"
            logger.error("replica %d failed its warm-up: %s", r.index, why)
            raise EngineUnavailableError(f"model replica {r.index} failed its warm-up: {why}") from None
        except ray.exceptions.RayActorError as e:  # its constructor raised (the weights did not load, say)
            lines = [ln for ln in str(e).splitlines() if ln.strip()]
            why = lines[-1].strip() if lines else type(e).__name__
            logger.error("replica %d could not start: %s", r.index, e)
            raise EngineUnavailableError(f"model replica {r.index} could not start: {why}") from None


def _preflight_error(index: int, report: NodeReport) -> ValueError:
    return ValueError(f"preflight failed for replica {index} on {report.label}: {report.failures()}")


def shutdown_replicas(replicas: list[Replica]) -> None:
    for r in replicas:
        try:
            ray.get(r.actor.shutdown.remote(), timeout=30)
        except Exception as e:  # already dead: its workers die with their placement group
            logger.debug("replica %d shutdown: %s", r.index, e)
        ray.kill(r.actor, no_restart=True)
        if r.placement_group is not None:
            remove_placement_group(r.placement_group)
