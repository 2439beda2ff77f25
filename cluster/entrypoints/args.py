"""Flags shared by several commands: sampling (vLLM's names) and how to reach a server."""
from __future__ import annotations

import argparse
import os

from pagedserve.common.sampling_params import SamplingParams


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                          min_p=ns.min_p, repetition_penalty=ns.repetition_penalty,
                          presence_penalty=ns.presence_penalty, frequency_penalty=ns.frequency_penalty,
                          seed=ns.sampling_seed, stop=ns.stop, ignore_eos=ns.ignore_eos)


def sampling_kwargs(ns: argparse.Namespace, names: tuple[str, ...]) -> dict:
    """The checked sampling flags as keyword arguments (for the gRPC client and the demo)."""
    return {k: v for k, v in vars(sampling_params_from(ns)).items() if k in names}


def add_server_target_args(p: argparse.ArgumentParser, api_key: bool = True) -> None:
    p.add_argument("--server", default="localhost:50051")
    p.add_argument("--tls", action="store_true")
    if api_key:
        p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"))
