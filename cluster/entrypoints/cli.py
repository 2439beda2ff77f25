"""The ``pagedserve`` command. Each command lives in its own module, imported only when that command runs, so the
light ones (``client``, ``health``: a load balancer or probe may run them every few seconds) load neither torch
nor Ray. A command module has ``add_arguments(parser)`` and ``run(namespace) -> exit code``."""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

COMMANDS = {
    "generate": ("pagedserve.cluster.entrypoints.generate", "complete prompts offline and print the text"),
    "serve": ("pagedserve.cluster.entrypoints.serve", "serve the model over gRPC on a Ray cluster"),
    "gateway": ("pagedserve.cluster.entrypoints.gateway",
                "serve the replicas of a running cluster (another `serve`'s) from one more gateway"),
    "client": ("pagedserve.cluster.entrypoints.client_cli",
               "send a prompt to a running server and print the completion"),
    "health": ("pagedserve.cluster.entrypoints.health", "print a server's gRPC health; exit 0 if SERVING"),
    "scale": ("pagedserve.cluster.entrypoints.scale",
              "change the number of replicas of a running server (drained and moved token-exact on scale-in)"),
    "rollout": ("pagedserve.cluster.entrypoints.rollout",
                "replace a running server's replicas one at a time with another model dir, without failing a request"),
    "doctor": ("pagedserve.cluster.entrypoints.doctor", "preflight checks on every node; exit 0 if all pass"),
    "demo": ("pagedserve.cluster.entrypoints.demo",
             "start the whole cluster, stream a few concurrent requests over gRPC, stop"),
}


def _top_parser() -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:<10} {help}" for name, (_, help) in COMMANDS.items())
    p = argparse.ArgumentParser(prog="pagedserve", description="Paged-KV LLM serving",
                                epilog=f"commands:\n{listing}\n\n'pagedserve COMMAND --help' for its options",
                                formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("command", nargs="?", choices=list(COMMANDS), metavar="COMMAND")
    return p


def main(argv: list[str] | None = None) -> int:
    # Ray forks helper processes while gRPC threads run; gRPC's fork handlers are not needed and log noise.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    # SIGTERM means drain, not a crash dump. Ray reads this when imported, so before any command module loads.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    ns, rest = top.parse_known_args(argv)
    if ns.command is None:
        top.print_help()
        return 0 if ns.help else 2
    if ns.help:
        rest.append("--help")
    module_name, help = COMMANDS[ns.command]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"pagedserve {ns.command}", description=help)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return module.run(args)
    except ValueError as e:  # bad options or a bad model dir: said in one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
