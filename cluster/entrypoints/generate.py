"""``pagedserve generate``: complete prompts offline with ``LLM`` and print the text."""
from __future__ import annotations

import argparse
import sys
import time

from pagedserve.cluster.entrypoints.args import add_sampling_args, sampling_params_from
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.llm import LLM


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="+")
    EngineArgs.add_cli_args(p)
    add_sampling_args(p)


def run(ns: argparse.Namespace) -> int:
    params = sampling_params_from(ns)
    args = EngineArgs.from_cli_args(ns)
    llm = LLM(**vars(args))
    t0 = time.perf_counter()
    outs = llm.generate(ns.prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_tokens = 0
    for out in outs:
        for c in out.outputs:
            n_tokens += len(c.token_ids)
            if len(outs) > 1:
                print(f"--- prompt: {out.prompt!r}")
            print(f"{out.prompt}{c.text}")
    print(f"[{len(outs)} prompt(s), {n_tokens} tokens in {dt:.2f}s, {n_tokens / max(dt, 1e-9):.1f} tok/s]",
          file=sys.stderr)
    return 0
