"""The `pagedserve` command line. Engine flags use vLLM's names."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from pagedserve.config import EngineArgs


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="local Hugging Face model dir (default: the bundled demo model)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--preemption-mode", choices=["recompute", "swap"], default=None)
    g.add_argument("--swap-space", type=float, default=4.0, help="GiB of CPU swap space per worker")
    g.add_argument("--attention-backend", choices=["torch", "triton", "cpu"], default=None)
    g.add_argument("--distributed-executor-backend", choices=["ray", "uni"], default=None,
                   help="ray: TP worker actors (the default when --tensor-parallel-size > 1)")
    g.add_argument("--ray-address", default=None, help="join this Ray cluster (default: RAY_ADDRESS, else start one)")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in EngineArgs.field_names()})


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


def sampling_params_from(ns: argparse.Namespace):
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                          min_p=ns.min_p, repetition_penalty=ns.repetition_penalty,
                          presence_penalty=ns.presence_penalty, frequency_penalty=ns.frequency_penalty,
                          seed=ns.sampling_seed, stop=ns.stop, ignore_eos=ns.ignore_eos)


def cmd_generate(ns: argparse.Namespace) -> int:
    from pagedserve.engine.llm import LLM

    params = sampling_params_from(ns)
    args = engine_args_from(ns)
    llm = LLM(**{k: getattr(args, k) for k in EngineArgs.field_names()})
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


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0")
    g.add_argument("--port", type=int, default=50051)
    g.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="require 'authorization: Bearer KEY' (default: $PAGEDSERVE_API_KEY)")
    g.add_argument("--ssl-certfile", default=None)
    g.add_argument("--ssl-keyfile", default=None)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="model replicas (each its own TP group)")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="per replica; beyond it requests get RESOURCE_EXHAUSTED")
    g.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running requests get on SIGTERM")
    g.add_argument("--served-model-name", default=None, help="the model_name label and GetModelInfo name")
    g.add_argument("--metrics-port", type=int, default=9400, help="Prometheus /metrics port (0: off)")


def cmd_serve(ns: argparse.Namespace) -> int:
    # SIGTERM means drain, not a crash dump; Ray reads this when imported.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    import uvloop

    from pagedserve.cluster.serve import ServeOptions, serve

    opts = ServeOptions(**{k: getattr(ns, k) for k in ServeOptions.__dataclass_fields__})
    # uvloop: the gateway's event loop wakes for every streamed token, and each wake costs less CPU than in asyncio's
    # own loop (CPU the engine shares on small hosts).
    uvloop.run(serve(engine_args_from(ns), opts))
    return 0


def cmd_client(ns: argparse.Namespace) -> int:
    import grpc

    from pagedserve.cluster.client import Client

    root = open(ns.ca_cert, "rb").read() if ns.ca_cert else None
    sampling = {k: v for k, v in vars(sampling_params_from(ns)).items()
                if k in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                         "presence_penalty", "frequency_penalty", "seed", "stop", "ignore_eos")}
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


def cmd_demo(ns: argparse.Namespace) -> int:
    from pagedserve.cluster.demo import run_demo

    sampling = {k: v for k, v in vars(sampling_params_from(ns)).items()
                if k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")}
    return run_demo(engine_args_from(ns), ns.prompts, sampling, ns.port, ns.data_parallel_size)


def cmd_health(ns: argparse.Namespace) -> int:
    import grpc

    from pagedserve.cluster.client import Client

    deadline = time.monotonic() + ns.wait
    with Client(ns.server, tls=ns.tls, timeout=5) as client:
        while True:
            try:
                status = client.health()
            except grpc.RpcError as e:
                status = e.code().name
            if status == "SERVING" or time.monotonic() >= deadline:
                print(status)
                return 0 if status == "SERVING" else 1
            time.sleep(0.2)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="Paged-KV LLM serving")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts offline and print the text")
    gen.add_argument("prompts", nargs="+")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the model over gRPC on a Ray cluster")
    add_engine_args(srv)
    add_serve_args(srv)
    srv.set_defaults(func=cmd_serve)

    cli = sub.add_parser("client", help="send a prompt to a running server and print the completion")
    cli.add_argument("prompt")
    cli.add_argument("--server", default="localhost:50051")
    cli.add_argument("--stream", action="store_true", help="print the text as it is generated")
    cli.add_argument("-n", type=int, default=1, help="completions to sample")
    cli.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"))
    cli.add_argument("--tls", action="store_true")
    cli.add_argument("--ca-cert", default=None, help="PEM root certificate(s) for TLS")
    cli.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    add_sampling_args(cli)
    cli.set_defaults(func=cmd_client)

    demo = sub.add_parser("demo", help="start the whole cluster, stream a few concurrent requests over gRPC, stop")
    demo.add_argument("prompts", nargs="*")
    demo.add_argument("--port", type=int, default=None, help="gateway port (default: a free one)")
    demo.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    add_engine_args(demo)
    add_sampling_args(demo)
    demo.set_defaults(func=cmd_demo, max_tokens=48)

    health = sub.add_parser("health", help="print a server's gRPC health; exit 0 if SERVING")
    health.add_argument("--server", default="localhost:50051")
    health.add_argument("--wait", type=float, default=0.0, help="poll up to this many seconds for SERVING")
    health.add_argument("--tls", action="store_true")
    health.set_defaults(func=cmd_health)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Ray forks helper processes while gRPC threads run; gRPC's fork handlers are not needed and log noise.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
