"""Build a model from a config, stream its safetensors weights into the weight loaders, then quantize it where
asked."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.common.config import ModelConfig
from pagedserve.worker.layers.quantization import quantize_linears
from pagedserve.worker.models.registry import get_model_class
from pagedserve.worker.models.weights import LazyWeight


def iterate_weights(files: list[str]) -> Iterator[tuple[str, LazyWeight]]:
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, LazyWeight(f.get_slice(name))


def load_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    cls = get_model_class(model_config.hf_config)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device):
            model = cls(model_config.hf_config)
    finally:
        torch.set_default_dtype(prev)
    model.load_weights(iterate_weights(model_config.weight_files))
    if model_config.quantization:
        quantize_linears(model, model_config.quantization)
    return model.eval()
