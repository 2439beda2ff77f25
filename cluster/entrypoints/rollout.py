"""``pagedserve rollout``: replace a running server's replicas, one at a time, by replicas of another model dir
(new weights of the same architecture; the served name stays) through its HTTP API's ``/rollout``. Light: neither
torch nor Ray is imported."""
from __future__ import annotations

import argparse

from pagedserve.cluster.entrypoints.admin_http import add_admin_target_args, post


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="the model dir the new replicas load (as the server sees it)")
    add_admin_target_args(p)


def run(ns: argparse.Namespace) -> int:
    return post(ns, "/rollout", {"model": ns.model})
