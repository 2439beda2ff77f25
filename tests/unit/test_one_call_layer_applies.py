"""The one-call C++ decoder layer takes exactly LLaMA-shaped layers: not Qwen3's q/k norms, Phi-3's LongRoPE tables
or Gemma's layers (which have no ``cpu_layers`` slot at all)."""
from __future__ import annotations

import transformers

from pagedserve.tests.utils import _base
from pagedserve.worker.cpu.decoder_layer import _llama_shaped
from pagedserve.worker.models.registry import get_model_class


def build(arch: str, **overrides):
    cls_name, kwargs = _base(arch)
    config = getattr(transformers, cls_name)(**{**kwargs, **overrides})
    config.architectures = [cls_name.replace("TextConfig", "ForCausalLM").replace("Config", "ForCausalLM")]
    return get_model_class(config)(config)


def test_only_llama_shaped_layers_qualify():
    assert _llama_shaped(build("llama").model.layers[0])
    assert _llama_shaped(build("phi3", rope_scaling=None).model.layers[0])  # plain rope: a LLaMA layer
    assert not _llama_shaped(build("phi3").model.layers[0])
    assert not _llama_shaped(build("qwen3").model.layers[0])
    assert not hasattr(build("gemma3").model, "cpu_layers")
