"""Resolved engine configuration (``EngineArgs.create_engine_config`` makes it; every layer reads it)."""
from __future__ import annotations

import functools
import glob
import json
import logging
import os
import time
from dataclasses import dataclass

import torch
from transformers import AutoConfig, GenerationConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16}


def default_model_dir() -> str:
    """The bundled demo model, used when no model is given."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "demo-model")


def _weight_files(model: str) -> list[str]:
    index = os.path.join(model, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model, n) for n in names]
    return sorted(glob.glob(os.path.join(model, "*.safetensors")))


@dataclass
class ModelConfig:
    model: str
    hf_config: object
    dtype: torch.dtype
    max_model_len: int
    weight_files: list[str]
    eos_token_ids: list[int]
    tokenizer: str  # its directory (the model's unless given)

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["?"])[0]

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @classmethod
    def from_dir(cls, model: str, dtype: str, max_model_len: int | None, device: torch.device,
                 tokenizer: str | None = None) -> ModelConfig:
        if not os.path.isdir(model):
            raise ValueError(f"model directory {model!r} does not exist")
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model directory {model!r} has no config.json")
        files = _weight_files(model)
        if not files or not all(os.path.isfile(f) for f in files):
            raise ValueError(f"model directory {model!r} has no *.safetensors weights")
        hf_config = AutoConfig.from_pretrained(model)
        torch_dtype = _resolve_dtype(dtype, hf_config, device)
        derived = _derive_max_model_len(hf_config)
        if max_model_len is None:
            max_model_len = derived
        elif max_model_len > derived:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit of {derived} tokens")
        eos = getattr(hf_config, "eos_token_id", None)
        try:
            eos = GenerationConfig.from_pretrained(model).eos_token_id
        except (OSError, ValueError):
            pass
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(model, hf_config, torch_dtype, max_model_len, files, eos_ids, tokenizer or model)


def _resolve_dtype(dtype: str, hf_config, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(cfg, str):
            cfg = _DTYPES.get(cfg)
        if device.type == "cpu":
            return cpu_auto_dtype(cfg if isinstance(cfg, torch.dtype) else torch.float32)
        return cfg if cfg in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


# CPU flags with which oneDNN runs the dtype's matmuls natively (AMX tiles, or AVX-512 dot-product instructions).
FAST_CPU_FLAGS = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")}


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def matmul_speedup(dtype: torch.dtype, n: int = 256, repeat: int = 3) -> float:
    """How many times faster an n x n matmul runs in ``dtype`` than in fp32 here (best of ``repeat``)."""
    pairs = {dt: (torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)) for dt in (torch.float32, dtype)}
    for a, b in pairs.values():  # first calls pay for library set-up
        a @ b
    best = {}
    for dt, (a, b) in pairs.items():
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
        best[dt] = min(times)
    return best[torch.float32] / best[dtype]


def choose_cpu_dtype(checkpoint: torch.dtype, flags: set[str], speedup=matmul_speedup) -> tuple[torch.dtype, str]:
    """The checkpoint's half dtype where this CPU has the instructions for it and a matmul probe confirms they
    beat fp32; fp32 otherwise. ``speedup(dtype)`` is only called when the flags are there."""
    if checkpoint not in FAST_CPU_FLAGS:
        return torch.float32, f"the checkpoint is {checkpoint}"
    have = sorted(f for f in FAST_CPU_FLAGS[checkpoint] if f in flags)
    if not have:
        return torch.float32, (f"this CPU has none of {'/'.join(FAST_CPU_FLAGS[checkpoint])} for {checkpoint} "
                               "matmuls (they would be emulated, many times slower than fp32)")
    ratio = speedup(checkpoint)
    if ratio < 1.0:
        return torch.float32, f"the CPU has {'/'.join(have)} but a {checkpoint} matmul measured {ratio:.2f}x fp32"
    return checkpoint, f"the CPU has {'/'.join(have)}; a {checkpoint} matmul measured {ratio:.2f}x fp32"


@functools.cache
def cpu_auto_dtype(checkpoint: torch.dtype) -> torch.dtype:
    """``dtype="auto"`` on CPU, decided (and logged) once per process and checkpoint dtype."""
    dtype, why = choose_cpu_dtype(checkpoint, cpu_flags())
    logger.info("dtype auto on CPU: %s (%s); --dtype overrides", str(dtype).removeprefix("torch."), why)
    return dtype


def _derive_max_model_len(hf_config) -> int:
    limits = [getattr(hf_config, k) for k in ("max_position_embeddings", "n_positions", "max_sequence_length")
              if isinstance(getattr(hf_config, k, None), int)]
    # We do not implement sliding-window attention, so stay within the window where it is set.
    window = getattr(hf_config, "sliding_window", None)
    if isinstance(window, int) and getattr(hf_config, "use_sliding_window", True):
        limits.append(window)
    return min(limits) if limits else 2048


# The defaults of everything a user sets live in ``EngineArgs`` alone.
@dataclass
class CacheConfig:
    block_size: int
    kv_cache_memory: int | None  # bytes for the KV pool (CPU, or to override profiling)
    num_gpu_blocks_override: int | None
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    swap_space: float  # GiB of CPU blocks per worker for swap preemption
    enable_block_sharing: bool  # False: forks copy all blocks (the no-sharing baseline)
    num_blocks: int = 0  # resolved from the workers' memory
    num_cpu_blocks: int = 0


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    preemption_mode: str | None  # None: swap for multi-sequence requests, else recompute


@dataclass
class ParallelConfig:
    tensor_parallel_size: int
    distributed_executor_backend: str  # "ray" (TP worker actors) or "uni" (in process)
    ray_address: str | None


def check_tensor_parallel(hf_config, tp: int) -> None:
    """Fail before any worker starts when the model cannot be split ``tp`` ways."""
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ValueError(f"num_attention_heads ({heads}) is not divisible by tensor_parallel_size ({tp})")
    if kv % tp and tp % kv:
        raise ValueError(f"num_key_value_heads ({kv}) and tensor_parallel_size ({tp}) must divide one another")
    inter = (getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "ffn_dim", None)
             or getattr(hf_config, "n_inner", None) or 4 * hf_config.hidden_size)
    if inter % tp:
        raise ValueError(f"the MLP width ({inter}) is not divisible by tensor_parallel_size ({tp})")


@dataclass(frozen=True)
class SpeculativeConfig:
    """n-gram (prompt lookup) speculative decoding, as vLLM's ``speculative_config`` with method "ngram": propose up
    to ``num_speculative_tokens`` tokens that followed the longest earlier match (``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens) of the sequence's suffix; draft only while at most ``max_batch_size`` sequences
    decode (a full batch already keeps the hardware busy)."""

    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    max_batch_size: int


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for; the input processor refuses more before anything is allocated for it."""

    max_seqs: int  # n, best_of and beam_width: the scheduler's max_num_seqs
    max_logprobs: int  # logprobs and prompt_logprobs (vLLM's max_logprobs)
    max_prompt_bytes: int  # a text prompt's UTF-8 size, checked before it is tokenized


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device: str
    seed: int
    attention_backend: str
    request_limits: RequestLimits
    speculative_config: SpeculativeConfig | None = None

