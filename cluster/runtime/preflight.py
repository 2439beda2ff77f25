"""Preflight checks (``pagedserve doctor``, and ``serve`` on each node that gets a replica): what would make a node
fail only after minutes of loading, or hang, found in seconds, each failure with its fix.

On each node, in the environment the ranks get (the raylet's, plus the job's runtime env): ``doctor`` runs a Ray task
per node; ``serve`` runs them in each replica's engine-core actor before it loads the engine (with GPU ranks in
actors of their own, in a task holding the first rank's GPU):
- network: ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, if set, name interfaces that exist and have an address
  (else gloo and NCCL fail at the first all-reduce); unset, the address the ranks meet at (the node's Ray IP: rank 0
  publishes ``tcp://<its node IP>:<port>``) and the interface holding it are reported;
- /dev/shm: big enough for Ray's object store and torch's shared tensors;
- versions: Python, torch, pagedserve, transformers and Ray equal to the driver's;
- model: the model's weights are at the same path on this node;
- memory: the weights plus the KV cache the engine will allocate (``memory_plan.py``) fit the node's available memory
  (CPU) or the GPU's.
"""
from __future__ import annotations

import os
import platform
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

import psutil
import ray
import torch
import transformers
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

import pagedserve
from pagedserve.cluster.runtime.memory_plan import kv_bytes_per_block, memory_plan
from pagedserve.common.config import EngineConfig
from pagedserve.engine.arg_utils import EngineArgs

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
SHM_PATH = "/dev/shm"
MIN_SHM_BYTES = 512 << 20
CHECK_TIMEOUT_S = 120.0  # a node's first task may wait for a worker process (and its runtime env) to start


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.name:<9} {'OK' if self.ok else 'FAIL':<4}  {self.detail}" + (
            "" if self.ok or not self.fix else f" -- fix: {self.fix}")


@dataclass
class NodeReport:
    node_id: str
    ip: str
    hostname: str
    versions: dict[str, str] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def label(self) -> str:
        return f"{self.ip} ({self.hostname} {self.node_id[:6]})" if self.hostname else self.ip

    def failures(self) -> str:
        """The failed checks in one message, each with its fix."""
        return "; ".join(f"{c.name}: {c.detail} (fix: {c.fix})" if c.fix else f"{c.name}: {c.detail}"
                         for c in self.checks if not c.ok)


class PreflightFailed(Exception):
    """A replica's node failed its checks (raised by its engine-core actor's warm-up; the launcher names the
    replica)."""

    def __init__(self, report: NodeReport) -> None:
        super().__init__(report)
        self.report = report


@dataclass
class DoctorReport:
    driver_versions: dict[str, str]
    checks: list[Check]  # the driver's own (the engine flags)
    nodes: list[NodeReport]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks) and all(n.ok for n in self.nodes)

    def lines(self) -> list[str]:
        out = [f"{'driver':<32} {c.line()}" for c in self.checks]
        out += [f"{n.label:<32} {c.line()}" for n in self.nodes for c in n.checks]
        return out


def local_versions() -> dict[str, str]:
    return {"python": platform.python_version(), "torch": torch.__version__, "pagedserve": pagedserve.__version__,
            "transformers": transformers.__version__, "ray": ray.__version__}


def check_versions(mine: Mapping[str, str], expected: Mapping[str, str] | None) -> Check:
    summary = ", ".join(f"{k} {v}" for k, v in mine.items())
    if expected is None:
        return Check("versions", True, summary)
    differ = [f"{k} {mine.get(k, 'missing')} here, {v} on the driver" for k, v in expected.items() if mine.get(k) != v]
    if not differ:
        return Check("versions", True, f"{summary} (as the driver)")
    return Check("versions", False, "; ".join(differ),
                 "install the same versions on every node and the driver (one image for the head and the workers)")


def interface_addresses() -> dict[str, list[str]]:
    """Each network interface and its IP addresses (none for an interface that is down or unconfigured)."""
    return {name: [a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
            for name, addrs in psutil.net_if_addrs().items()}


def _named_interfaces(var: str, value: str, interfaces: Mapping[str, list[str]]) -> tuple[list[str], list[str]]:
    """(the interfaces ``var=value`` selects, the names in it that select none), as gloo and NCCL read it: gloo takes
    exact names, comma-separated, and needs all of them; NCCL takes name prefixes, ``=`` for exact names, ``^`` to
    exclude, and needs one."""
    if var == "GLOO_SOCKET_IFNAME":
        names = [n for n in value.split(",") if n]
        return [n for n in names if n in interfaces], [n for n in names if n not in interfaces]
    exclude, spec = value.startswith("^"), value.lstrip("^")
    exact, spec = spec.startswith("="), spec.lstrip("=")
    patterns = [p for p in spec.split(",") if p]

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in patterns)

    picked = [n for n in interfaces if hit(n) != exclude]
    return picked, ([] if picked else [value])


def check_network(environ: Mapping[str, str], node_ip: str, interfaces: Mapping[str, list[str]]) -> list[Check]:
    holder = next((n for n, addrs in interfaces.items() if node_ip in addrs), None)
    listing = ", ".join(f"{n} ({', '.join(a) or 'no address'})" for n, a in interfaces.items())
    usable = [n for n, a in interfaces.items() if a]
    suggest = holder if holder and holder != "lo" else next((n for n in usable if n != "lo"), holder or "lo")
    checks = []
    for var in IFNAME_VARS:
        value = environ.get(var)
        if not value:
            continue
        picked, unknown = _named_interfaces(var, value, interfaces)
        bare = [n for n in picked if not interfaces[n]]
        if var == "NCCL_SOCKET_IFNAME":
            bad = not any(interfaces[n] for n in picked)
        else:
            bad = bool(unknown or bare)
        if not bad:
            checks.append(Check("network", True, f"{var}={value}: {', '.join(picked)} "
                                                 f"({', '.join(a for n in picked for a in interfaces[n])})"))
            continue
        what = (f"no interface named {', '.join(unknown)}" if unknown
                else f"{', '.join(bare or picked)} has no address")
        checks.append(Check(
            "network", False, f"{var}={value}: {what} on this node; its interfaces: {listing}",
            f"export {var}={suggest} (one of: {', '.join(usable)}) where `ray start` runs on this node (or set it in "
            "the job's runtime env), or unset it"))
    if not checks:
        where = holder or "held by no local interface"
        checks.append(Check("network", True, f"ranks meet at {node_ip} ({where}); {' and '.join(IFNAME_VARS)} unset: "
                                             "gloo binds the address this host name resolves to, NCCL picks an "
                                             "interface itself"))
    return checks


def check_shm(path: str = SHM_PATH, minimum: int = MIN_SHM_BYTES) -> Check:
    fix = ("give the container a larger /dev/shm: `docker run --shm-size=8g`, or in Kubernetes mount an emptyDir "
           "with `medium: Memory` at /dev/shm")
    try:
        st = os.statvfs(path)
    except OSError as e:
        return Check("shm", False, f"{path}: {e}", fix)
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    detail = f"{path} {_gib(size)} ({_gib(free)} free)"
    if size < minimum:
        return Check("shm", False, f"{detail}, under the {_gib(minimum)} Ray's object store and torch need", fix)
    return Check("shm", True, detail)


def check_model_files(config: EngineConfig) -> Check:
    missing = [p for p in config.model_config.weight_files if not os.path.isfile(p)]
    if missing:
        return Check("model", False, f"{len(missing)} of the model's weight files are not on this node "
                                     f"(first: {missing[0]})",
                     "put the model at the same path on every node (a shared volume, or copy it)")
    return Check("model", True, f"{config.model_config.model} ({len(config.model_config.weight_files)} weight "
                                "file(s))")


def check_memory(config: EngineConfig) -> Check:
    if config.device == "cuda" and not torch.cuda.is_available():
        return Check("memory", False, "no GPU visible to the check on this node",
                     "give the node GPUs (`ray start --num-gpus`), or serve with --device cpu")
    plan = memory_plan(config)
    need = plan.weight_bytes + plan.kv_bytes
    where = "one GPU's (free, within --gpu-memory-utilization)" if plan.device == "cuda" else "available RAM"
    detail = (f"weights {_gib(plan.weight_bytes)} + KV cache {_gib(plan.kv_bytes)} ({plan.kv_tokens} tokens a rank) "
              f"= {_gib(need)} of {_gib(plan.available_bytes)} {where}")
    if need > plan.available_bytes:
        room = max(plan.available_bytes - plan.weight_bytes, 0)
        ranks = 1 if plan.device == "cuda" else config.parallel_config.tensor_parallel_size
        return Check("memory", False, f"{detail}: does not fit",
                     f"lower --kv-cache-memory-bytes (at most {room // ranks} here) or --max-model-len, raise "
                     "--tensor-parallel-size on GPUs, or free or add memory")
    if plan.kv_tokens < 1:  # the engine would refuse to start
        return Check("memory", False, f"{detail}: the KV cache holds not one block",
                     f"raise --kv-cache-memory-bytes to at least {kv_bytes_per_block(config)} (a block), or leave it "
                     "unset")
    window = config.cache_config.sliding_window
    longest = min(plan.max_model_len, window + config.cache_config.block_size) if window else plan.max_model_len
    if plan.kv_tokens < longest:  # allowed (small caches are legitimate); the requests that cannot fit are refused
        detail += (f"; fewer tokens than max_model_len ({plan.max_model_len}): longer requests will be refused "
                   "(--max-model-len or a larger KV cache would fix that)")
    return Check("memory", True, detail)


def node_checks(config: EngineConfig | None, expected_versions: Mapping[str, str] | None,
                plan_memory: bool = True) -> NodeReport:
    """Every check on the node this runs on; ``config`` None: the engine flags are bad (the driver says so), so
    no model or memory check; ``plan_memory`` False on a node no replica can use (no GPU for a CUDA engine)."""
    ip = ray.util.get_node_ip_address()
    versions = local_versions()
    report = NodeReport(ray.get_runtime_context().get_node_id(), ip, socket.gethostname(), versions)
    report.checks += check_network(os.environ, ip, interface_addresses())
    report.checks.append(check_shm())
    report.checks.append(check_versions(versions, expected_versions))
    if config is not None and plan_memory:
        model = check_model_files(config)
        report.checks.append(model)
        if model.ok:
            report.checks.append(check_memory(config))
    return report


_node_checks = ray.remote(num_cpus=0, max_retries=0)(node_checks)


def _collect(ref: ray.ObjectRef, node_id: str, ip: str, timeout: float) -> NodeReport:
    """The node's report, or one failed check saying why the task did not answer."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        why, fix = (f"the check task did not run in {timeout:.0f} s",
                    "check that the node's raylet is up (`ray status`) and, on GPUs, that a GPU is free")
    except ray.exceptions.RayError as e:
        cause = getattr(e, "cause", None) or e
        last = (str(cause).strip().splitlines() or [""])[-1]
        why, fix = (f"the check task failed: {type(cause).__name__}: {last}",
                    "install the same pagedserve, torch and Ray on every node")
    return NodeReport(node_id, ip, "", checks=[Check("reachable", False, why, fix)])


def run_doctor(args: EngineArgs, nodes: list[str] | None = None, expected_versions: Mapping[str, str] | None = None,
               timeout: float = CHECK_TIMEOUT_S) -> DoctorReport:
    """Run the node checks on each of ``nodes`` (Ray node ids; default: every alive node) of the connected Ray
    cluster, comparing versions against ``expected_versions`` (default: this process's)."""
    driver_versions = local_versions()
    expected = dict(driver_versions if expected_versions is None else expected_versions)
    checks, config = [], None
    try:
        config = args.create_engine_config()
        checks.append(Check("config", True, f"{config.model_config.model} on {config.device}, tensor_parallel_size="
                                            f"{config.parallel_config.tensor_parallel_size}"))
    except ValueError as e:
        checks.append(Check("config", False, str(e), "fix the engine flags (the same ones `serve` gets)"))
    alive = [n for n in ray.nodes() if n["Alive"] and (nodes is None or n["NodeID"] in nodes)]
    gpu = config is not None and config.device == "cuda"
    pending = []
    for n in alive:
        # A node no replica can use (a CPU-only head of a GPU cluster) gets no memory plan.
        usable = n["Resources"].get("GPU" if gpu else "CPU", 0) > 0
        opts = {"num_gpus": 1} if gpu and usable else {}
        ref = _node_checks.options(
            **opts, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
        ).remote(config, expected, usable)
        pending.append((ref, n["NodeID"], n["NodeManagerAddress"]))
    reports = [_collect(ref, node_id, ip, timeout) for ref, node_id, ip in pending]
    return DoctorReport(driver_versions, checks, reports)


def checks_in_engine_actor(config: EngineConfig) -> bool:
    """Whether a replica's engine-core actor can run its node's checks itself, before it loads the engine (a task
    of its own costs a Ray worker that imports torch): everywhere but GPU ranks in actors of their own, whose free
    GPU memory only a task holding a rank's GPU can read."""
    return not (config.device == "cuda" and config.parallel_config.distributed_executor_backend == "ray")


def check_placement_group(pg: PlacementGroup, config: EngineConfig, timeout: float = CHECK_TIMEOUT_S) -> NodeReport:
    """The node checks on the node holding ``pg`` (a replica's, placed), against this process's versions, in a
    task that takes the GPU of the first rank's bundle (before the engine does) to read its free memory."""
    ref = _node_checks.options(
        num_gpus=1,
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=1),
    ).remote(config, local_versions())
    return _collect(ref, "", "the replica's node", timeout)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"
