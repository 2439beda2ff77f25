"""``pagedserve demo``: the whole system in one command. Starts Ray (or joins RAY_ADDRESS), the scheduler and
worker actors and the gRPC gateway, streams a few concurrent requests through the gRPC client, prints the
completions as they arrive and a throughput line, then shuts everything down."""
from __future__ import annotations

import asyncio
import sys
import time

from pagedserve.cluster.client import AsyncClient
from pagedserve.cluster.server_thread import ServerThread
from pagedserve.config import EngineArgs

DEFAULT_PROMPTS = ["def __init__(self", "import os\n\ndef ", "class Parser:\n    def ", "def read_lines(path):\n"]


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


def run_demo(args: EngineArgs, prompts: list[str] | None, sampling: dict, port: int | None = None,
             data_parallel_size: int = 1) -> int:
    prompts = prompts or DEFAULT_PROMPTS
    print(f"starting the cluster (Ray, scheduler + worker actors, gRPC gateway) on {args.model or 'the bundled demo model'}",
          file=sys.stderr, flush=True)
    t_start = time.perf_counter()
    opts = {"data_parallel_size": data_parallel_size}
    srv = ServerThread(args, **opts) if port is None else ServerThread(args, port=port, **opts)
    srv.start(timeout=600)
    print(f"gateway SERVING on {srv.target} after {time.perf_counter() - t_start:.1f} s; "
          f"sending {len(prompts)} concurrent streaming requests", file=sys.stderr, flush=True)
    try:
        tokens, dt, ttft = asyncio.run(_run_requests(srv.target, prompts, sampling))
    finally:
        srv.stop()
    print(f"[{len(prompts)} requests, {tokens} tokens in {dt:.2f} s = {tokens / dt:.1f} tok/s over gRPC; "
          f"mean TTFT {1000 * sum(ttft) / max(len(ttft), 1):.0f} ms; shut down cleanly]", flush=True)
    return 0
