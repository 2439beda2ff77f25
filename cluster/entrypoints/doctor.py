"""``pagedserve doctor``: the preflight checks ``serve`` runs on each replica's node (see ``runtime.preflight``), on
every node of the Ray cluster, with the engine flags ``serve`` would get. One line per check per node; exit 0 if all
pass, 1 if any fails."""
from __future__ import annotations

import argparse
import os

import ray

from pagedserve.cluster.runtime.preflight import CHECK_TIMEOUT_S, run_doctor
from pagedserve.cluster.runtime.private_ray import PrivateRay
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.executor.ray_utils import ensure_ray


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model dir (as --model)")
    p.add_argument("--check-timeout", type=float, default=CHECK_TIMEOUT_S,
                   help="seconds a node may take to run its checks before it is reported unreachable")
    EngineArgs.add_cli_args(p)


def run(ns: argparse.Namespace) -> int:
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise ValueError(f"two models given: {ns.model_tag!r} and --model {ns.model!r}")
        ns.model = ns.model_tag
    args = EngineArgs.from_cli_args(ns)
    # As `serve`: without a cluster to join, a private one, whose workers get this shell's environment.
    private_ray = None
    if not ray.is_initialized() and not (args.ray_address or os.environ.get("RAY_ADDRESS")):
        private_ray = PrivateRay()
        private_ray.start()
    else:
        ensure_ray(args.ray_address)
    try:
        report = run_doctor(args, timeout=ns.check_timeout)
    finally:
        if private_ray is not None:
            private_ray.stop()
    for line in report.lines():
        print(line, flush=True)
    failed = sum(not c.ok for c in report.checks) + sum(not c.ok for n in report.nodes for c in n.checks)
    print(f"{len(report.nodes)} node(s): " + ("all checks passed" if report.ok else f"{failed} check(s) failed"))
    return 0 if report.ok else 1
