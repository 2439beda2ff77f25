"""``pagedserve client``: send one prompt to a running server and print the completion (no torch, no Ray)."""
from __future__ import annotations

import argparse
import sys

import grpc

from pagedserve.cluster.client import Client
from pagedserve.cluster.entrypoints.args import add_sampling_args, add_server_target_args, sampling_kwargs

_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "stop", "ignore_eos")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    add_server_target_args(p)
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    p.add_argument("-n", type=int, default=1, help="completions to sample")
    p.add_argument("--ca-cert", default=None, help="PEM root certificate(s) for TLS")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    add_sampling_args(p)


def run(ns: argparse.Namespace) -> int:
    root = open(ns.ca_cert, "rb").read() if ns.ca_cert else None
    sampling = sampling_kwargs(ns, _SAMPLING)
    sampling["n"] = ns.n
    if ns.n > 1 and ns.temperature == 0.0:
        sampling["temperature"] = 1.0
    with Client(ns.server, api_key=ns.api_key, tls=ns.tls, root_certificates=root, timeout=ns.timeout) as client:
        try:
            if ns.stream and ns.n == 1:
                print(ns.prompt, end="", flush=True)
                for d in client.generate_stream(ns.prompt, **sampling):
                    print(d.text, end="", flush=True)
                print()
            else:
                result = client.generate(ns.prompt, stream=False, **sampling)
                for c in result.completions:
                    if len(result.completions) > 1:
                        print(f"--- completion {c.index} ({c.finish_reason})")
                    print(ns.prompt + c.text)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0
