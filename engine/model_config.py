"""A local Hugging Face model directory read into a ``ModelConfig``: its config, weight files, dtype and context
length, checked before any worker starts."""
from __future__ import annotations

import glob
import json
import os

import torch
from transformers import AutoConfig, GenerationConfig

from pagedserve.common.config import AttentionShape, ModelConfig
from pagedserve.worker.cpu import auto_dtype

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16}


def load_model_config(model: str, dtype: str, max_model_len: int | None, device: torch.device,
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
    return ModelConfig(model, hf_config, torch_dtype, max_model_len, files, eos_ids, tokenizer or model)


def _weight_files(model: str) -> list[str]:
    index = os.path.join(model, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model, n) for n in names]
    return sorted(glob.glob(os.path.join(model, "*.safetensors")))


def _resolve_dtype(dtype: str, hf_config, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(cfg, str):
            cfg = _DTYPES.get(cfg)
        if device.type == "cpu":
            return auto_dtype(cfg if isinstance(cfg, torch.dtype) else torch.float32)
        return cfg if cfg in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _derive_max_model_len(hf_config) -> int:
    limits = [getattr(hf_config, k) for k in ("max_position_embeddings", "n_positions", "max_sequence_length")
              if isinstance(getattr(hf_config, k, None), int)]
    return min(limits) if limits else 2048


def check_tensor_parallel(hf_config, tp: int) -> None:
    """Fail before any worker starts when the model cannot be split ``tp`` ways."""
    shape = AttentionShape.of(hf_config)
    heads, kv = shape.num_heads, shape.num_kv_heads
    if heads % tp:
        raise ValueError(f"num_attention_heads ({heads}) is not divisible by tensor_parallel_size ({tp})")
    if kv % tp and tp % kv:
        raise ValueError(f"num_key_value_heads ({kv}) and tensor_parallel_size ({tp}) must divide one another")
    inter = (getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "ffn_dim", None)
             or getattr(hf_config, "n_inner", None) or 4 * hf_config.hidden_size)
    if inter % tp:
        raise ValueError(f"the MLP width ({inter}) is not divisible by tensor_parallel_size ({tp})")


def check_quantization(hf_config, method: str) -> None:
    """Fail before any worker starts where ``quantization=method`` cannot apply: the checkpoint is quantized
    already (its weights are not the full-precision ones quantizing at load starts from)."""
    existing = getattr(hf_config, "quantization_config", None)
    if existing:
        found = (existing.get("quant_method", "?") if isinstance(existing, dict)
                 else getattr(existing, "quant_method", "?"))
        raise ValueError(f"quantization={method!r} quantizes a full-precision (bf16/fp16/fp32) checkpoint at load, "
                         f"but this checkpoint is already quantized (quantization_config: {found}); leave "
                         "quantization unset")
