"""Model FLOPs of a workload, counted exactly, and the fastest a machine could run it, from its measured matmul and
memory-read rates: the ceiling a benchmark's model FLOP utilization (MFU) is read against.

MFU here is every FLOP the model must do for the workload (prompt and decode tokens through the decoder layers,
the LM head for each sampled token, attention over each token's context) over elapsed time x the matmul peak.
The floor replays the scheduler's policy (all requests at t=0, decodes first, then chunked prefills within the
token budget) and charges each step ``max(matmul FLOPs / peak, weight bytes / read rate) + KV bytes read by its
decodes / read rate``: the matmuls at the peak, weights read at least once a step, and the memory-bound decode
attention after them, as both pagedserve and vLLM run a step (one op after another on all cores). Norms,
sampling, Python and KV writes are left out, so the floor is below any real run of that design.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.worker.cpu.hugepages import zeros_huge_pages


@dataclass
class Roofline:
    model_flops: float  # the workload's model FLOPs (the MFU numerator)
    kv_read_bytes: float  # K and V read by decode steps
    weight_read_bytes: float  # weights read once per step
    steps: int
    floor_s: float  # the fastest run at the peak and the read rate (see the module docstring)

    def mfu(self, elapsed_s: float, peak_flops: float) -> float:
        return self.model_flops / (elapsed_s * peak_flops)


def read_bandwidth(n_bytes: int = 1 << 30, repeat: int = 5, device: str = "cpu") -> float:
    """The device's memory read rate, best of ``repeat``: on CPU the C++ streaming probe (``csrc/stream.cpp``: every
    byte of ``n_bytes`` on huge pages read once on the kernels' threads, with the L2 prefetch the GEMMs use; summing
    a tensor with torch read 20-25% slower on an AMX Xeon), elsewhere (or without the extension) summing a large
    fp32 tensor on all threads."""
    if device == "cpu" and cpu_extension.available():
        buf = zeros_huge_pages((n_bytes,), torch.uint8)
        read = lambda: cpu_extension.load().stream_read(buf)  # noqa: E731
    else:
        x = torch.ones(n_bytes // 4, device=device)
        read = x.sum
    best = 0.0
    for _ in range(repeat):
        t = time.perf_counter()
        read()
        if device == "cuda":
            torch.cuda.synchronize()
        best = max(best, n_bytes / (time.perf_counter() - t))
    return best


def roofline(cfg: dict, prompt_lens: list[int], output_lens: list[int], elem_bytes: int, peak_flops: float,
             read_bw: float, max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
             kv_elem_bytes: int | None = None, prefill_first: bool = False) -> Roofline:
    """``cfg``: a LLaMA-style config (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    intermediate_size, vocab_size). Each request's first output token comes from its prompt's last position.
    ``kv_elem_bytes``: the KV cache's element size where it differs from the weights' (an fp8 cache: 1).
    The steps replayed are the scheduler's: every running request, then waiting ones, in the token budget; with
    ``prefill_first``, decodes sit out while a prompt can run (the scheduler's ``max_decode_stall_ms`` when no
    decode waits out its limit)."""
    h, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv_dim = h * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    layer_params = n_layers * (h * (h + 2 * kv_dim) + h * h + 3 * h * cfg["intermediate_size"])
    head_params = h * cfg["vocab_size"]
    weight_bytes = (layer_params + head_params) * elem_bytes
    kv_bytes_per_token = 2 * n_layers * kv_dim * (kv_elem_bytes or elem_bytes)

    def attention_flops(pos0: int, n: int) -> float:  # n tokens from position pos0, each over its context
        return 4 * n_layers * h * (n * pos0 + n * (n + 1) / 2)

    waiting = list(range(len(prompt_lens)))
    computed = [0] * len(prompt_lens)  # tokens in the cache
    produced = [0] * len(prompt_lens)
    running: list[int] = []
    flops = kv = weights = floor = 0.0
    steps = 0
    while running or waiting:
        budget, tokens, rows, step_kv, attn, decode_attn = max_num_batched_tokens, 0, 0, 0.0, 0.0, 0.0
        scheduled: list[tuple[int, int]] = []
        pending = {r: prompt_lens[r] + produced[r] - computed[r] for r in running}
        hold = prefill_first and (any(n > 1 for n in pending.values()) or (waiting and len(running) < max_num_seqs))
        for r in running:
            if hold and pending[r] == 1:
                continue
            n = min(pending[r], budget)
            if n <= 0:
                break
            scheduled.append((r, n))
            budget -= n
        while waiting and budget > 0 and len(running) < max_num_seqs:
            r = waiting.pop(0)
            running.append(r)
            n = min(prompt_lens[r], budget)
            scheduled.append((r, n))
            budget -= n
        for r, n in scheduled:
            if n == 1 and computed[r] >= prompt_lens[r]:  # a decode: reads its whole context
                step_kv += (computed[r] + 1) * kv_bytes_per_token
                decode_attn += attention_flops(computed[r], 1)
            else:
                attn += attention_flops(computed[r], n)
            tokens += n
            computed[r] += n
            if computed[r] == prompt_lens[r] + produced[r]:  # sampled this step
                produced[r] += 1
                rows += 1
        matmul = 2 * layer_params * tokens + 2 * head_params * rows + attn
        flops += matmul + decode_attn
        kv += step_kv
        weights += weight_bytes
        floor += max(matmul / peak_flops, weight_bytes / read_bw) + step_kv / read_bw
        running = [r for r in running if produced[r] < output_lens[r]]
        steps += 1
    return Roofline(flops, kv, weights, steps, floor)
