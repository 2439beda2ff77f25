"""vLLM's own serving client (`vllm bench serve`) against any OpenAI-compatible server, its result as JSON.

Run with the vLLM venv (bash benchmarks/setup_vllm_cpu.sh), never pagedserve's: this file imports only vLLM.

    benchmarks/.venv-vllm/bin/python benchmarks/bench_vllm_client.py --out result.json -- <vllm bench serve arguments>

The `vllm` console script of the CPU build fails (it looks up the distribution "vllm", which installs as
"vllm-cpu"), so this calls `vllm.benchmarks.serve.main` with the arguments `vllm bench serve` would parse. The
result written is the dict ``main`` returns, with the per-request lists reduced to what a comparison checks
(prompt and output lengths as the client counted them, and the errors).
"""
from __future__ import annotations

import argparse
import json
import sys


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    own = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    own.add_argument("--out", required=True, help="result JSON path")
    args = own.parse_args(argv[:split])

    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    bench_args = parser.parse_args(argv[split + 1:])
    bench_args.save_detailed = True  # keep the per-request lists in the returned dict
    result = bench_main(bench_args)
    errors = [e for e in result.get("errors") or [] if e]
    keep = {k: v for k, v in result.items()
            if not isinstance(v, list) or k in ("input_lens", "output_lens")}
    keep["errors"] = errors[:10]
    keep["ttft_s"] = result.get("ttfts")
    keep["latency_s"] = result.get("latencies")
    with open(args.out, "w") as f:
        json.dump(keep, f)


if __name__ == "__main__":
    main()
