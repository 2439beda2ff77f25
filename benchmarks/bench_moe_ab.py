"""A/B of pagedserve alone on bench-mixtral-tiny (issue #66: fused MoE on CPU): one process loads the engine once,
then times offline ``LLM.generate`` at each batch size (requests = batch, all at once, greedy, ``ignore_eos``), on
bench_moe.py's decode-heavy workload (token ids from ``default_rng(0)``, prompt 32, output 64). Run it from each tree
(``PYTHONPATH`` picks the tree) and alternate the trees; it prints one JSON line.

    python benchmarks/bench_moe_ab.py [--dtype float32] [--batches 1,8,32,64] [--tag new]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

import pagedserve
from pagedserve import LLM, SamplingParams

MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".models", "bench-mixtral-tiny")
VOCAB = 32000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)  # the same ids as bench_moe.py's (its prompts are a prefix of these)
    prompts = [rng.integers(3, VOCAB, args.prompt_len).tolist() for _ in range(max(batches))]

    fused_calls = [0]
    try:  # count the fused MoE op's calls where the tree has one (absent before the fused op)
        from pagedserve.kernels.cpu import moe as moe_kernel

        inner = moe_kernel.fused_moe

        def counted(*a, **k):
            fused_calls[0] += 1
            return inner(*a, **k)

        moe_kernel.fused_moe = counted
    except ImportError:
        fused_calls[0] = None

    load = os.getloadavg()
    t0 = time.perf_counter()
    res = {"tag": args.tag, "pagedserve": pagedserve.__file__, "dtype": args.dtype, "threads": torch.get_num_threads(),
           "load_before": [round(x, 2) for x in load], "runs": {}}
    with LLM(args.model, skip_tokenizer_init=True, dtype=args.dtype, seed=0) as llm:
        res["load_s"] = round(time.perf_counter() - t0, 1)
        llm.generate([{"prompt_token_ids": p[:8]} for p in prompts[:4]],
                     SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
        for b in batches:
            llm.reset_prefix_cache()
            params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            t, c = time.perf_counter(), time.process_time()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:b]], params, use_tqdm=False)
            dt, cpu = time.perf_counter() - t, time.process_time() - c
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
            res["runs"][str(b)] = {"elapsed_s": round(dt, 3), "output_tok_s": round(b * args.output_len / dt, 2),
                                   "cpu_s": round(cpu, 3),  # all threads: less skewed by other load than wall time
                                   "first_ids": list(outs[0].outputs[0].token_ids[:8])}
    res["fused_moe_calls"] = fused_calls[0]
    res["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
