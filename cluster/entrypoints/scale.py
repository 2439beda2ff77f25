"""``pagedserve scale``: change the number of replicas of a running server (its HTTP API's ``/scale_elastic_ep``,
vLLM's route). Light: neither torch nor Ray is imported."""
from __future__ import annotations

import argparse

from pagedserve.cluster.entrypoints.admin_http import add_admin_target_args, post


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, required=True, help="the number of replicas to serve with")
    p.add_argument("--pool", choices=("prefill", "decode"), default=None,
                   help="with disaggregated prefill and decode: the pool to scale (default: decode)")
    add_admin_target_args(p)


def run(ns: argparse.Namespace) -> int:
    body: dict = {"new_data_parallel_size": ns.replicas}
    if ns.pool is not None:
        body["pool"] = ns.pool
    return post(ns, "/scale_elastic_ep", body)
