"""Tensor parallelism on Ray, measured on this machine.

    python benchmarks/bench_tp.py [--requests 128]

1. Broadcast round trip of one step's SchedulerOutput (128 decoding sequences) to 2 ranks: plain actor
   calls (one object-store put, then a call per rank) vs a Ray Compiled Graph (shared-memory channels).
2. TP=1 (in-process) vs TP=2 (Ray actors, gloo; broadcast by plain calls and by compiled graph) output
   tok/s on bench-llama-58m, alpaca-like requests.
3. The TP=2 step split into schedule / broadcast / prepare / forward / sample.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__file__))
import ray
from bench_common import make_workload, reference_model, save_results

from pagedserve import EngineArgs, LLMEngine, SamplingParams
from pagedserve.engine.executor.ray_executor import RayExecutor
from pagedserve.engine.executor.ray_utils import ensure_ray
from pagedserve.scheduler.output import CachedSeqData, SchedulerOutput


@ray.remote(num_cpus=0.5)
class Echo:
    def step(self, sched: SchedulerOutput) -> int:
        return sched.total_num_scheduled_tokens


def _payload(num_seqs: int = 128) -> SchedulerOutput:
    out = SchedulerOutput()
    for i in range(num_seqs):
        out.scheduled_cached_seqs.append(CachedSeqData(i, [1234], [i] if i % 16 == 0 else [], 300 + i, 20))
        out.num_scheduled_tokens[i] = 1
    out.total_num_scheduled_tokens = num_seqs
    return out


def broadcast_round_trip(iters: int = 300) -> dict:
    workers = [Echo.remote() for _ in range(2)]
    payload = _payload()
    ray.get([w.step.remote(payload) for w in workers])

    def plain():
        ref = ray.put(payload)
        return ray.get([w.step.remote(ref) for w in workers])

    t = time.perf_counter()
    for _ in range(iters):
        plain()
    plain_ms = (time.perf_counter() - t) / iters * 1e3
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as inp:
        dag = MultiOutputNode([w.step.bind(inp) for w in workers])
    compiled = dag.experimental_compile()
    try:
        ray.get(compiled.execute(payload))
        t = time.perf_counter()
        for _ in range(iters):
            ray.get(compiled.execute(payload))
        compiled_ms = (time.perf_counter() - t) / iters * 1e3
    finally:
        compiled.teardown()
    for w in workers:
        ray.kill(w)
    return {"plain_ms": plain_ms, "compiled_graph_ms": compiled_ms, "payload_seqs": 128}


def throughput(model_dir: str, n: int) -> dict:
    wl = make_workload("alpaca")
    tokens = sum(wl.output_lens[:n])
    result = {}
    for name, tp, compiled in (("tp1", 1, None), ("tp2_plain_calls", 2, False), ("tp2_compiled_graph", 2, True)):
        args = EngineArgs(model=model_dir, skip_tokenizer_init=True, tensor_parallel_size=tp, kv_cache_memory=1 << 30)
        executor = None if tp == 1 else (lambda cfg, c=compiled: RayExecutor(cfg, use_compiled_graph=c))
        engine = LLMEngine.from_engine_args(args, executor)
        for i, (p, o) in enumerate(zip(wl.prompts[:n], wl.output_lens[:n])):
            engine.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=o,
                                                                                  ignore_eos=True))
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        result[f"{name}_out_tok_s"] = tokens / (time.perf_counter() - t)
        engine.core.shutdown()
    return result


def step_split(model_dir: str, running: int = 64, steps: int = 20) -> dict:
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, skip_tokenizer_init=True, tensor_parallel_size=2,
                                                   kv_cache_memory=1 << 30))
    wl = make_workload("sharegpt")
    for i in range(running):
        engine.add_request(str(i), {"prompt_token_ids": wl.prompts[i][:128]},
                           SamplingParams(temperature=0, max_tokens=256, ignore_eos=True))
    core = engine.core
    while len(core.scheduler.running) < running or any(
            s.num_computed_tokens < s.num_tokens - 1 for r in core.scheduler.running for s in r.seqs):
        engine.step()
    rows = []
    for _ in range(steps):
        engine.step()
        s = core.last_step
        worker = sum(s.worker.values())
        rows.append({"schedule": s.schedule + s.update, "broadcast": s.execute - worker, **s.worker})
    engine.core.shutdown()
    return {"running": running, **{k: statistics.mean(r[k] for r in rows) for k in rows[0]}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=128)
    args = ap.parse_args()
    ensure_ray()
    model_dir = reference_model("bench-llama-58m")
    rt = broadcast_round_trip()
    print(f"broadcast round trip to 2 ranks: plain actor calls {rt['plain_ms']:.2f} ms, "
          f"compiled graph {rt['compiled_graph_ms']:.2f} ms")
    tput = throughput(model_dir, args.requests)
    print(f"bench-llama-58m, {args.requests} alpaca-like requests, out tok/s: TP=1 {tput['tp1_out_tok_s']:.1f}, "
          f"TP=2 plain calls {tput['tp2_plain_calls_out_tok_s']:.1f}, TP=2 compiled graph "
          f"{tput['tp2_compiled_graph_out_tok_s']:.1f} (2 cores: TP cannot add compute here)")
    split = step_split(model_dir)
    print("TP=2 step at {running} running: ".format(**split) + ", ".join(
        f"{k} {v * 1e3:.2f} ms" for k, v in split.items() if k != "running"))
    print("saved", save_results("tp", {"broadcast": rt, "throughput": tput, "step_split_tp2": split}))


if __name__ == "__main__":
    main()
