"""Resolved engine configuration, plain data (``EngineArgs.create_engine_config`` makes it; every layer reads it)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig


# Weight-only int8 with per-output-channel scales, quantized at load from a full-precision checkpoint.
QUANTIZATION_METHODS = ("int8",)


def utf8_size_over(text: str, limit: int) -> int | None:
    """The UTF-8 size of ``text`` where it exceeds ``limit`` bytes (``max_prompt_bytes``), else None. Lone surrogates,
    which JSON can carry, count the 3 bytes each that ``surrogatepass`` writes; the text is only encoded where it could
    be over (a character is at most 4 bytes)."""
    if len(text) * 4 <= limit:
        return None
    size = len(text.encode("utf-8", "surrogatepass"))
    return size if size > limit else None


@dataclass(frozen=True)
class AttentionShape:
    """A model's attention heads as Hugging Face configs give them: ``num_key_value_heads`` defaults to the query
    heads (no GQA), ``head_dim`` to ``hidden_size / num_attention_heads``."""

    num_heads: int
    num_kv_heads: int
    head_size: int

    @classmethod
    def of(cls, hf_config: PretrainedConfig) -> AttentionShape:
        heads = hf_config.num_attention_heads
        return cls(heads, getattr(hf_config, "num_key_value_heads", None) or heads,
                   getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads split over ``tp`` ranks, or each rank holding one copy where there are fewer than ranks."""
        return max(1, self.num_kv_heads // tp)


def default_model_dir() -> str:
    """The bundled demo model, used when no model is given."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "demo-model")


@dataclass
class ModelConfig:
    model: str
    hf_config: PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    weight_files: list[str]
    eos_token_ids: list[int]
    tokenizer: str  # its directory (the model's unless given)
    quantization: str | None = None  # one of QUANTIZATION_METHODS: weights quantized at load

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["?"])[0]

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


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
    cache_dtype: str = "auto"  # vLLM's kv_cache_dtype: "auto" (the model's), "fp8" (= "fp8_e4m3"), "fp8_e5m2"
    num_blocks: int = 0  # resolved from the workers' memory
    num_cpu_blocks: int = 0
    sliding_window: int | None = None  # set when every layer slides: KV blocks below the window are freed


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    preemption_mode: str | None  # None: swap for multi-sequence requests, else recompute
    max_decode_stall_ms: float = 0.0  # 0: every running decode in every step (vLLM v1's mixing)
    stream_interval: int = 1  # streamed: an output per this many new tokens (the first and last at once)
    scheduling_policy: str = "fcfs"  # or "priority": by (priority, arrival), see scheduler/request_queue.py
    fairness: str = "none"  # or "tokens": among equal priorities, the tenant with the least weighted service first
    kv_lease_s: float = 60.0  # how long a prefill replica holds a handed-off prompt's KV for its decode replica


@dataclass
class ParallelConfig:
    tensor_parallel_size: int
    distributed_executor_backend: str  # "ray" (TP worker actors) or "uni" (in process)
    ray_address: str | None


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


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Grammar compiles for structured output: ``cache_size`` compiled grammars kept (least recently used out
    first); a grammar that takes longer than ``compile_timeout`` seconds ends its request with an error; beyond
    ``max_pending_compiles`` compiles queued or running, a request that needs another is refused."""

    cache_size: int = 256
    compile_timeout: float = 10.0
    max_pending_compiles: int = 64


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
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)

