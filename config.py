"""Engine configuration: what the user asks for (``EngineArgs``) and what it resolves to."""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field, fields

import torch

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

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["?"])[0]

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @classmethod
    def from_dir(cls, model: str, dtype: str, max_model_len: int | None, device: torch.device) -> "ModelConfig":
        from transformers import AutoConfig, GenerationConfig

        if not os.path.isdir(model):
            raise ValueError(f"model directory {model!r} does not exist")
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model directory {model!r} has no config.json")
        files = _weight_files(model)
        if not files or not all(os.path.isfile(f) for f in files):
            raise ValueError(f"model directory {model!r} has no *.safetensors weights")
        hf_config = AutoConfig.from_pretrained(model)
        from pagedserve.worker.models.registry import check_architecture

        check_architecture(hf_config)
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
        return cls(model, hf_config, torch_dtype, max_model_len, files, eos_ids)


def _resolve_dtype(dtype: str, hf_config, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cpu":
            # Half-precision matmuls are ~100x slower than fp32 on CPUs without AMX.
            return torch.float32
        cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(cfg, str):
            cfg = _DTYPES.get(cfg)
        return cfg if cfg in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _derive_max_model_len(hf_config) -> int:
    limits = [getattr(hf_config, k) for k in ("max_position_embeddings", "n_positions", "max_sequence_length")
              if isinstance(getattr(hf_config, k, None), int)]
    # We do not implement sliding-window attention, so stay within the window where it is set.
    window = getattr(hf_config, "sliding_window", None)
    if isinstance(window, int) and getattr(hf_config, "use_sliding_window", True):
        limits.append(window)
    return min(limits) if limits else 2048


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV pool (CPU, or to override profiling)
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    swap_space: float = 4.0  # GiB of CPU blocks per worker for swap preemption
    enable_block_sharing: bool = True  # False: forks copy all blocks (the no-sharing baseline)
    num_blocks: int = 0  # resolved by the workers
    num_cpu_blocks: int = 0


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str | None = None  # None: swap for multi-sequence requests, else recompute


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    ray_address: str | None = None


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


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device: str
    seed: int
    attention_backend: str


@dataclass
class EngineArgs:
    """Flat, user-facing options (vLLM's names) that resolve into an :class:`EngineConfig`."""

    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False  # token ids in, token ids out (no text)
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    kv_cache_memory: int | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str | None = None
    swap_space: float = 4.0
    enable_block_sharing: bool = True
    attention_backend: str | None = None
    distributed_executor_backend: str | None = None  # "ray" (default when tensor_parallel_size > 1)
    ray_address: str | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)} - {"extra"}

    def create_engine_config(self) -> EngineConfig:
        from pagedserve.kernels import BACKENDS, default_backend

        if self.extra:
            raise ValueError(f"unknown engine arguments: {sorted(self.extra)}")
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model = self.model or default_model_dir()
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        backend = self.attention_backend or default_backend(device)
        if backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {sorted(BACKENDS)}, got {backend!r}")
        if self.distributed_executor_backend not in (None, "ray", "uni"):
            raise ValueError(f"distributed_executor_backend must be 'ray' or 'uni', got {self.distributed_executor_backend!r}")
        model_config = ModelConfig.from_dir(model, self.dtype, self.max_model_len, torch.device(device))
        check_tensor_parallel(model_config.hf_config, self.tensor_parallel_size)
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
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching, swap_space=self.swap_space,
                enable_block_sharing=self.enable_block_sharing),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs, max_num_batched_tokens=batched, max_model_len=max_len,
                enable_chunked_prefill=self.enable_chunked_prefill, preemption_mode=self.preemption_mode),
            parallel_config=ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend,
                                           self.ray_address),
            device=device, seed=self.seed, attention_backend=backend)
