"""``pagedserve scale``: change the number of replicas of a running server (its HTTP API's ``/scale_elastic_ep``,
vLLM's route). Light: neither torch nor Ray is imported."""
from __future__ import annotations

import argparse

from pagedserve.cluster.entrypoints.admin_http import add_admin_target_args, post


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, required=True, help="the number of replicas to serve with")
    add_admin_target_args(p)


def run(ns: argparse.Namespace) -> int:
    return post(ns, "/scale_elastic_ep", {"new_data_parallel_size": ns.replicas})
