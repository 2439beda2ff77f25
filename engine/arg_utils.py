"""``EngineArgs``: the flat, user-facing engine options (vLLM's names), their one set of defaults, the CLI flags
generated from them, and their resolution into an ``EngineConfig``."""
from __future__ import annotations

import argparse
import json
import typing
from dataclasses import MISSING, dataclass, field, fields

import torch

from pagedserve.common.config import (
    QUANTIZATION_METHODS,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    RequestLimits,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    default_model_dir,
)
from pagedserve.engine.model_config import check_quantization, check_tensor_parallel, load_model_config
from pagedserve.kernels.select import BACKENDS, KV_CACHE_DTYPES, default_backend
from pagedserve.scheduler.request_queue import FAIRNESS_MODES, SCHEDULING_POLICIES
from pagedserve.worker.layers.attention import kv_sliding_window
from pagedserve.worker.models.registry import check_architecture

BLOCK_SIZES = (8, 16, 32, 64, 128)
# A text prompt of more UTF-8 bytes per token of context than this cannot fit; refusing it before tokenizing keeps
# a multi-megabyte body from costing seconds of CPU and gigabytes of tokenizer memory.
PROMPT_BYTES_PER_TOKEN = 64


def _arg(default, help: str, **cli):
    """A field with its CLI help; ``cli`` may hold ``choices`` and ``aliases`` (extra flag names)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineArgs:
    model: str | None = _arg(None, "local Hugging Face model dir (default: the bundled demo model)")
    tokenizer: str | None = _arg(None, "tokenizer dir (default: the model dir)")
    skip_tokenizer_init: bool = _arg(False, "token ids in, token ids out (no text)")
    tensor_parallel_size: int = _arg(1, "tensor-parallel ranks (Ray worker actors)", aliases=["-tp"])
    dtype: str = _arg("auto", "model and KV-cache dtype", choices=["auto", "float32", "float16", "bfloat16"])
    quantization: str | None = _arg(None, "quantize the weights at load: int8 = weight-only int8, per output "
                                          "channel, the LM head's included (embeddings stay in --dtype)",
                                    choices=list(QUANTIZATION_METHODS), aliases=["-q"])
    device: str = _arg("auto", "auto: cuda when available, else cpu", choices=["auto", "cpu", "cuda"])
    seed: int = _arg(0, "engine seed (per-request seeds come from the sampling parameters)")
    block_size: int = _arg(16, "tokens per KV-cache block", choices=list(BLOCK_SIZES))
    max_num_seqs: int = _arg(256, "sequences per step at most")
    max_num_batched_tokens: int | None = _arg(None, "tokens per step at most (default 2048)")
    max_model_len: int | None = _arg(None, "context length (default: the model's)")
    kv_cache_memory: int | None = _arg(None, "bytes for the KV cache (default: profiled on GPU, 20%% of free RAM "
                                             "on CPU)", aliases=["--kv-cache-memory-bytes"])
    kv_cache_dtype: str = _arg("auto", "KV-cache storage: auto (the model's dtype), or fp8 (= fp8_e4m3) / fp8_e5m2 "
                                       "with a per-tensor scale per layer (twice the blocks of bf16)",
                               choices=["auto", *KV_CACHE_DTYPES])
    num_gpu_blocks_override: int | None = _arg(None, "KV-cache blocks, overriding the memory-based count")
    gpu_memory_utilization: float = _arg(0.9, "fraction of GPU memory for weights, activations and KV cache")
    enable_chunked_prefill: bool = _arg(True, "split long prompts over steps")
    max_decode_stall_ms: float = _arg(2000.0, "while prompts wait, hold running decodes back for up to this long "
                                              "each (plus one step) so the prompts prefill first: lower TTFT under "
                                              "bursts for longer gaps between tokens; 0 mixes every decode into "
                                              "every step, as vLLM v1 does")
    stream_interval: int = _arg(1, "streamed requests get an output per this many new tokens (the first and the "
                                   "last at once): fewer, larger chunks cost the server and clients less per "
                                   "token; a request's stream_interval may raise it")
    scheduling_policy: str = _arg("fcfs", "fcfs: first come, first served; priority: by the requests' priority "
                                          "(lower first), then arrival; a waiting request preempts running ones "
                                          "of a worse priority", choices=list(SCHEDULING_POLICIES))
    fairness: str = _arg("none", "tokens: among waiting requests of equal priority, admit from the tenant with the "
                                 "least weighted service in tokens so far (a virtual token counter); none: in order",
                         choices=list(FAIRNESS_MODES))
    kv_lease_timeout: float = _arg(60.0, "disaggregated serving: seconds a prefill replica holds a handed-off "
                                         "prompt's KV blocks for its decode replica's pull at most (freed at once "
                                         "when the pull is acknowledged or the request ends)")
    enable_prefix_caching: bool = _arg(True, "reuse the KV blocks of shared prompt prefixes")
    preemption_mode: str | None = _arg(None, "default: swap for multi-sequence requests, else recompute",
                                       choices=["recompute", "swap"])
    swap_space: float = _arg(4.0, "GiB of CPU swap space per worker")
    enable_block_sharing: bool = _arg(True, "share KV blocks between forked sequences (off: the copying baseline)")
    attention_backend: str | None = _arg(None, "default: triton on CUDA, cpu on CPU", choices=sorted(BACKENDS))
    distributed_executor_backend: str | None = _arg(
        None, "ray: TP worker actors (the default when --tensor-parallel-size > 1); uni: in process",
        choices=["ray", "uni"])
    ray_address: str | None = _arg(None, "join this Ray cluster (default: RAY_ADDRESS, else start one)")
    max_logprobs: int = _arg(20, "most logprobs / prompt_logprobs a request may ask for")
    max_prompt_bytes: int | None = _arg(None, f"largest text prompt in UTF-8 bytes (default: {PROMPT_BYTES_PER_TOKEN} "
                                              "x max_model_len)")
    structured_outputs_cache_size: int = _arg(256, "compiled grammars kept for structured output (least recently "
                                                   "used out first)")
    structured_outputs_compile_timeout: float = _arg(10.0, "seconds a grammar may take to compile; a request whose "
                                                           "grammar takes longer ends with an error")
    structured_outputs_max_pending_compiles: int = _arg(64, "grammar compiles queued or running at most; beyond, a "
                                                            "request needing another is refused (retry later)")
    speculative_config: dict | None = _arg(  # noqa: RUF009 (_arg returns a dataclasses.field, not a shared dict)
        None, 'speculative decoding as JSON, vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_min": 1, "prompt_lookup_max": 4, "disable_by_batch_size": 8}')

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field (``--max-num-seqs``; booleans as ``--x/--no-x``), defaults from the fields."""
        group = parser.add_argument_group("engine")
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            kind = typing.get_args(hints[f.name]) or (hints[f.name],)
            kind = next(t for t in kind if t is not type(None))
            names = [f"--{f.name.replace('_', '-')}", *f.metadata.get("aliases", [])]
            kw = {"default": f.default if f.default is not MISSING else None, "help": f.metadata["help"]}
            if kind is bool:
                group.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
            elif kind is dict:
                group.add_argument(*names, type=json.loads, metavar="JSON", **kw)
            else:
                group.add_argument(*names, type=kind, choices=f.metadata.get("choices"), **kw)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{k: v for k, v in vars(ns).items() if k in cls.field_names()})

    def create_engine_config(self) -> EngineConfig:
        """Resolve and check everything; raises ValueError before any worker starts."""
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {self.block_size}")
        for name in ("max_num_seqs", "tensor_parallel_size", "max_logprobs", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.structured_outputs_cache_size < 0:
            raise ValueError(f"structured_outputs_cache_size must be at least 0, got "
                             f"{self.structured_outputs_cache_size}")
        if self.structured_outputs_max_pending_compiles < 1:
            raise ValueError(f"structured_outputs_max_pending_compiles must be at least 1, got "
                             f"{self.structured_outputs_max_pending_compiles}")
        if not self.structured_outputs_compile_timeout > 0:
            raise ValueError(f"structured_outputs_compile_timeout must be positive, got "
                             f"{self.structured_outputs_compile_timeout}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, got "
                             f"{self.scheduling_policy!r}")
        if not 0 < self.kv_lease_timeout < float("inf"):
            raise ValueError(f"kv_lease_timeout must be a positive number of seconds, got {self.kv_lease_timeout}")
        if self.fairness not in FAIRNESS_MODES:
            raise ValueError(f"fairness must be one of {list(FAIRNESS_MODES)}, got {self.fairness!r}")
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        check_kv_cache_dtype(self.kv_cache_dtype, device)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)} or None, got "
                             f"{self.quantization!r}")
        backend = self.attention_backend or default_backend(device)
        if backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {sorted(BACKENDS)}, got {backend!r}")
        executor = self.distributed_executor_backend
        if executor not in (None, "ray", "uni"):
            raise ValueError(f"distributed_executor_backend must be 'ray' or 'uni', got {executor!r}")
        if executor is None:
            executor = "ray" if self.tensor_parallel_size > 1 else "uni"
        elif executor == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("distributed_executor_backend 'uni' runs tensor_parallel_size=1 only")
        model_config = load_model_config(self.model or default_model_dir(), self.dtype, self.max_model_len,
                                         torch.device(device), self.tokenizer)
        check_architecture(model_config.hf_config)
        check_tensor_parallel(model_config.hf_config, self.tensor_parallel_size)
        if self.quantization:
            check_quantization(model_config.hf_config, self.quantization)
            model_config.quantization = self.quantization
        max_len = model_config.max_model_len
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 2048 if self.enable_chunked_prefill else max(2048, max_len)
        if not self.enable_chunked_prefill and batched < max_len:
            raise ValueError(
                f"max_num_batched_tokens ({batched}) must be at least max_model_len ({max_len}) "
                "when chunked prefill is disabled")
        if batched < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {batched}")
        if not 0 <= self.max_decode_stall_ms < float("inf"):
            raise ValueError(f"max_decode_stall_ms must be a finite number of ms, 0 or more, got "
                             f"{self.max_decode_stall_ms}")
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching, swap_space=self.swap_space,
                enable_block_sharing=self.enable_block_sharing, cache_dtype=self.kv_cache_dtype,
                sliding_window=kv_sliding_window(model_config.hf_config)),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs, max_num_batched_tokens=batched, max_model_len=max_len,
                enable_chunked_prefill=self.enable_chunked_prefill, preemption_mode=self.preemption_mode,
                max_decode_stall_ms=self.max_decode_stall_ms, stream_interval=self.stream_interval,
                scheduling_policy=self.scheduling_policy, fairness=self.fairness, kv_lease_s=self.kv_lease_timeout),
            parallel_config=ParallelConfig(self.tensor_parallel_size, executor, self.ray_address),
            device=device, seed=self.seed, attention_backend=backend,
            request_limits=RequestLimits(self.max_num_seqs, self.max_logprobs,
                                         self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * max_len),
            speculative_config=speculative_config(self.speculative_config),
            structured_outputs_config=StructuredOutputsConfig(
                self.structured_outputs_cache_size, self.structured_outputs_compile_timeout,
                self.structured_outputs_max_pending_compiles))


def check_kv_cache_dtype(name: str, device: str) -> None:
    """Refuses a KV-cache dtype this machine cannot store and read: Triton's fp8_e4m3 needs compute capability 8.9
    (Ada, Hopper) or newer."""
    if name != "auto" and name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {['auto', *KV_CACHE_DTYPES]}, got {name!r}")
    if device == "cuda" and KV_CACHE_DTYPES.get(name) == torch.float8_e4m3fn:
        capability = torch.cuda.get_device_capability()
        if capability < (8, 9):
            raise ValueError(f"kv_cache_dtype={name!r} (fp8_e4m3) needs a GPU of compute capability 8.9 or newer; "
                             f"this one is {capability[0]}.{capability[1]}: use fp8_e5m2 or auto")


# Above this many decoding sequences a step is already wide enough that verifying drafts costs more than it saves
# (benchmarks/bench_speculative.py measures where).
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE = 8


def speculative_config(spec: dict | None) -> SpeculativeConfig | None:
    """vLLM's ``speculative_config`` dict, checked; only method "ngram" (prompt lookup) is built in."""
    if not spec:
        return None
    spec = dict(spec)
    method = spec.pop("method", "ngram")
    if method != "ngram":
        raise ValueError(f"speculative_config: method must be 'ngram' (prompt lookup), got {method!r}")
    known = {"num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
    k = spec.get("num_speculative_tokens")
    lo = spec.get("prompt_lookup_min", 1)
    hi = spec.get("prompt_lookup_max", max(lo, 4))
    batch = spec.get("disable_by_batch_size", DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE)
    for name, v in (("num_speculative_tokens", k), ("prompt_lookup_min", lo), ("prompt_lookup_max", hi),
                    ("disable_by_batch_size", batch)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"speculative_config: {name} must be a positive integer, got {v!r}")
    if lo > hi:
        raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
    return SpeculativeConfig(k, lo, hi, batch)
