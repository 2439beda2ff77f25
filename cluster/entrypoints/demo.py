"""``pagedserve demo``: the whole system in one command. Starts Ray (or joins RAY_ADDRESS), the engine-core and
worker actors and the gRPC gateway, streams a few concurrent requests through the gRPC client, prints the
completions as they arrive and a throughput line, then shuts everything down. The gateway and the clients share
this process's event loop, as separate processes would share a host."""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

import uvloop

from pagedserve.cluster.client import AsyncClient
from pagedserve.cluster.entrypoints.args import add_sampling_args, sampling_kwargs
from pagedserve.cluster.entrypoints.serve import serve
from pagedserve.cluster.entrypoints.serve_options import ServeOptions
from pagedserve.cluster.server.gateway import Gateway
from pagedserve.engine.arg_utils import EngineArgs

DEFAULT_PROMPTS = ["def __init__(self", "import os\n\ndef ", "class Parser:\n    def ", "def read_lines(path):\n"]
_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")


class _Printer:
    """Prints each stream's text line by line, tagged with its request number, as the lines complete."""

    def __init__(self, out=sys.stdout) -> None:
        self.out = out
        self.pending: dict[int, str] = {}

    def feed(self, i: int, text: str, final: bool = False) -> None:
        buf = self.pending.get(i, "") + text
        *lines, rest = buf.split("\n")
        for line in lines:
            print(f"[{i}] {line}", file=self.out, flush=True)
        if final and rest:
            print(f"[{i}] {rest}", file=self.out, flush=True)
            rest = ""
        self.pending[i] = rest


async def _run_requests(target: str, prompts: list[str], sampling: dict) -> tuple[int, float, list[float]]:
    printer = _Printer()
    ttft: list[float] = []

    async def one(i: int, client: AsyncClient) -> int:
        t0 = time.perf_counter()
        printer.feed(i, prompts[i])
        n = 0
        async for d in client.generate_stream(prompts[i], **sampling):
            if n == 0:
                ttft.append(time.perf_counter() - t0)
            n += len(d.token_ids)
            printer.feed(i, d.text, final=d.finish_reason is not None)
        return n

    async with AsyncClient(target) as client:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*[one(i, client) for i in range(len(prompts))])
        return sum(counts), time.perf_counter() - t0, ttft


async def run_demo(args: EngineArgs, prompts: list[str], sampling: dict, opts: ServeOptions) -> None:
    print(f"starting the cluster (Ray, engine-core + worker actors, gRPC gateway) on "
          f"{args.model or 'the bundled demo model'}", file=sys.stderr, flush=True)
    t_start = time.perf_counter()
    stop = asyncio.Event()
    ready: asyncio.Future[Gateway] = asyncio.get_running_loop().create_future()
    server = asyncio.ensure_future(serve(args, opts, stop, on_ready=ready.set_result))
    await asyncio.wait([server, ready], return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():  # serve() ended before it was ready: its error
        await server
        raise RuntimeError("the server stopped before it was ready")
    target = f"127.0.0.1:{ready.result().port}"
    print(f"gateway SERVING on {target} after {time.perf_counter() - t_start:.1f} s; "
          f"sending {len(prompts)} concurrent streaming requests", file=sys.stderr, flush=True)
    try:
        tokens, dt, ttft = await _run_requests(target, prompts, sampling)
    finally:
        stop.set()
        await server
    print(f"[{len(prompts)} requests, {tokens} tokens in {dt:.2f} s = {tokens / dt:.1f} tok/s over gRPC; "
          f"mean TTFT {1000 * sum(ttft) / max(len(ttft), 1):.0f} ms; shut down cleanly]", flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="*")
    p.add_argument("--grpc-port", type=int, default=0, help="gRPC port (default: a free one)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    EngineArgs.add_cli_args(p)
    add_sampling_args(p)
    p.set_defaults(max_tokens=48)


def run(ns: argparse.Namespace) -> int:
    opts = ServeOptions(host="127.0.0.1", grpc_port=ns.grpc_port, data_parallel_size=ns.data_parallel_size,
                        metrics_port=0)
    uvloop.run(run_demo(EngineArgs.from_cli_args(ns), ns.prompts or DEFAULT_PROMPTS, sampling_kwargs(ns, _SAMPLING),
                        opts))
    return 0
