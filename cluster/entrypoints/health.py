"""``pagedserve health``: print a server's gRPC health and exit 0 when SERVING (no torch, no Ray: a probe)."""
from __future__ import annotations

import argparse
import time

import grpc

from pagedserve.cluster.client import Client
from pagedserve.cluster.entrypoints.args import add_server_target_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_server_target_args(p, api_key=False)  # health checks need no key
    p.add_argument("--ca-cert", default=None, help="PEM root certificate(s) for TLS (default: the system's)")
    p.add_argument("--wait", type=float, default=0.0, help="poll up to this many seconds for SERVING")


def run(ns: argparse.Namespace) -> int:
    deadline = time.monotonic() + ns.wait
    root = open(ns.ca_cert, "rb").read() if ns.ca_cert else None
    with Client(ns.server, tls=ns.tls, root_certificates=root, timeout=5) as client:
        while True:
            try:
                status = client.health()
            except grpc.RpcError as e:
                status = e.code().name
            if status == "SERVING" or time.monotonic() >= deadline:
                print(status)
                return 0 if status == "SERVING" else 1
            time.sleep(0.2)
