"""GPU benchmark of the Triton paged-attention kernels.

Decode: achieved KV-cache read bandwidth against the device-to-device copy bandwidth measured in
the same run (target: >= 70%). Prefill: attention TFLOP/s against the bf16 torch.matmul rate.
Batch sizes 1-256, contexts 128-8192. Writes benchmarks/results/kernels-<gpu>.{json,png}.

    python benchmarks/bench_kernels.py [--quick] [--results-dir DIR]

The end-to-end GPU comparison (bench-llama-7b-shape, output tok/s vs HF generate(), sequential and static
batching, bf16) is the throughput benchmark run on the GPU:

    python benchmarks/bench_throughput.py --model bench-llama-7b-shape --device cuda

Kernel times exclude the wrapper's one device-to-host sync (the batch stats are passed in, as an
engine that knows max_seq_len on the host would); see ``triton_attention.paged_attention``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import pathlib
import re
import sys

import torch

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
CONTEXTS = [128, 256, 512, 1024, 2048, 4096, 8192]
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3-8B-like layer
PREFILL_MAX_TOKENS = 64 * 1024  # larger prefill batches only repeat the same tiles
RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def copy_bandwidth_gbps(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9  # read + write


def matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = bench_ms(lambda: torch.matmul(a, b))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def make_batch(q_lens: list[int], seq_lens: list[int], k_cache: torch.Tensor) -> dict:
    """A batch whose sequences use shuffled physical blocks of the shared cache."""
    need = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
    perm = torch.randperm(k_cache.shape[0], device="cuda")[: sum(need)]
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used : used + n]
        used += n
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return dict(
        query=torch.randn(starts[-1], NUM_Q_HEADS, HEAD_SIZE, dtype=k_cache.dtype, device="cuda"),
        block_tables=table,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        stats=(max(q_lens), max(seq_lens), starts[-1]),
    )


def run_attention(batch: dict, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor):
    from pagedserve.kernels.triton import attention as triton_attention

    return lambda: triton_attention.paged_attention(
        batch["query"], k_cache, v_cache, batch["block_tables"], batch["query_start_loc"],
        batch["seq_lens"], HEAD_SIZE**-0.5, out, stats=batch["stats"],
    )


def check_against_reference(k_cache: torch.Tensor, v_cache: torch.Tensor) -> float:
    """Max abs error vs torch_ref on a small mixed batch, so fast-but-wrong shows up here."""
    from pagedserve.kernels import torch_ref
    from pagedserve.kernels.triton import ops as triton_ops

    batch = make_batch([1, 1, 37, 300], [700, 4097, 37, 900], k_cache)
    batch.pop("stats")
    args = (batch["query"], k_cache, v_cache, batch["block_tables"], batch["query_start_loc"], batch["seq_lens"])
    got = triton_ops.paged_attention(*args, HEAD_SIZE**-0.5)
    want = torch_ref.paged_attention(*args, HEAD_SIZE**-0.5)
    return (got.float() - want.float()).abs().max().item()


def bench_decode(k_cache, v_cache, copy_gbps: float, batches, contexts) -> list[dict]:
    from pagedserve.kernels.triton import attention as triton_attention

    rows = []
    kv_bytes_per_token = 2 * NUM_KV_HEADS * HEAD_SIZE * k_cache.element_size()
    for b in batches:
        for ctx in contexts:
            batch = make_batch([1] * b, [ctx] * b, k_cache)
            out = torch.empty_like(batch["query"])
            ms = bench_ms(run_attention(batch, k_cache, v_cache, out))
            nbytes = b * ctx * kv_bytes_per_token + 2 * batch["query"].numel() * out.element_size()
            gbps = nbytes / (ms * 1e-3) / 1e9
            cfg = triton_attention.choose_config(
                num_seqs=b, max_q_len=1, max_seq_len=ctx, num_kv_heads=NUM_KV_HEADS,
                gqa=NUM_Q_HEADS // NUM_KV_HEADS, head_size=HEAD_SIZE,
                num_sms=triton_attention._num_sms(k_cache.device),
            )
            rows.append(dict(batch=b, context=ctx, ms=ms, gbps=gbps, frac_of_copy=gbps / copy_gbps,
                             num_splits=cfg.num_splits))
            print(f"decode  B={b:4d} ctx={ctx:5d} {ms * 1e3:9.1f} us {gbps:8.0f} GB/s "
                  f"{100 * gbps / copy_gbps:5.1f}% of copy  splits={cfg.num_splits}")
    return rows


def bench_prefill(k_cache, v_cache, matmul: float, batches, contexts) -> list[dict]:
    rows = []
    for b in batches:
        for ctx in contexts:
            if b * ctx > PREFILL_MAX_TOKENS:
                continue
            batch = make_batch([ctx] * b, [ctx] * b, k_cache)
            out = torch.empty_like(batch["query"])
            ms = bench_ms(run_attention(batch, k_cache, v_cache, out))
            # causal: query i sees i + 1 keys; QK^T and PV are 2 FLOPs per multiply-add each
            flops = 4 * NUM_Q_HEADS * HEAD_SIZE * b * ctx * (ctx + 1) / 2
            tflops = flops / (ms * 1e-3) / 1e12
            rows.append(dict(batch=b, context=ctx, ms=ms, tflops=tflops, frac_of_matmul=tflops / matmul))
            print(f"prefill B={b:4d} ctx={ctx:5d} {ms:9.3f} ms {tflops:7.1f} TFLOP/s "
                  f"{100 * tflops / matmul:5.1f}% of bf16 matmul")
    return rows


def plot(path: pathlib.Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_d, ax_p) = plt.subplots(1, 2, figsize=(13, 5))
    for b in sorted({r["batch"] for r in result["decode"]}):
        pts = [r for r in result["decode"] if r["batch"] == b]
        ax_d.plot([r["context"] for r in pts], [100 * r["frac_of_copy"] for r in pts], marker="o", label=f"B={b}")
    ax_d.axhline(70, color="gray", linestyle="--", label="target 70%")
    ax_d.set(xlabel="context", ylim=(0, 105), ylabel="% of D2D copy bandwidth",
             title=f"decode (copy {result['copy_gbps']:.0f} GB/s)")
    for b in sorted({r["batch"] for r in result["prefill"]}):
        pts = [r for r in result["prefill"] if r["batch"] == b]
        ax_p.plot([r["context"] for r in pts], [r["tflops"] for r in pts], marker="o", label=f"B={b}")
    ax_p.axhline(result["matmul_tflops"], color="gray", linestyle="--", label="bf16 matmul")
    ax_p.set(xlabel="context", ylabel="TFLOP/s", title="prefill (causal)")
    ax_p.set_ylim(bottom=0)
    for ax in (ax_d, ax_p):
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"pagedserve Triton paged attention, {result['device']}, bf16, "
                 f"Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_SIZE} block={BLOCK_SIZE}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few batch sizes and contexts only")
    parser.add_argument("--results-dir", type=pathlib.Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/bench_kernels.py: no CUDA device found; this benchmark needs a GPU. Nothing to do.")
        return 0
    batches = [1, 16, 256] if args.quick else BATCHES
    contexts = [128, 1024, 8192] if args.quick else CONTEXTS

    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    max_tokens = max(max(batches) * max(contexts), PREFILL_MAX_TOKENS)
    num_blocks = math.ceil(max_tokens / BLOCK_SIZE) + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")

    max_err = check_against_reference(k_cache, v_cache)
    print(f"max |triton - torch_ref| on a mixed batch: {max_err:.3e}")
    copy_gbps = copy_bandwidth_gbps()
    matmul = matmul_tflops()
    print(f"{device}: D2D copy {copy_gbps:.0f} GB/s, bf16 matmul {matmul:.0f} TFLOP/s")

    result = dict(
        device=device,
        date=dt.datetime.now().isoformat(timespec="seconds"),
        torch=torch.__version__,
        triton=__import__("triton").__version__,
        shape=dict(num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                   block_size=BLOCK_SIZE, dtype="bfloat16"),
        max_abs_err_vs_torch_ref=max_err,
        copy_gbps=copy_gbps,
        matmul_tflops=matmul,
        decode=bench_decode(k_cache, v_cache, copy_gbps, batches, contexts),
        prefill=bench_prefill(k_cache, v_cache, matmul, batches, contexts),
    )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()
    stem = args.results_dir / f"kernels-{slug}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(stem.with_suffix(".png"), result)
    best = max(r["frac_of_copy"] for r in result["decode"])
    print(f"wrote {stem}.json and .png; best decode bandwidth {100 * best:.1f}% of copy (target 70%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
