"""Architecture name (config.json ``architectures``) -> our model class."""
from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "GPTNeoXForCausalLM": ("gpt_neox", "GPTNeoXForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}

SUPPORTED_ARCHITECTURES = sorted(_MODELS)


def check_architecture(hf_config) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in _MODELS:
            return arch
    raise ValueError(f"unsupported model architecture {archs or '(none in config.json)'}; "
                     f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def get_model_class(hf_config):
    module, cls = _MODELS[check_architecture(hf_config)]
    return getattr(importlib.import_module(f"pagedserve.worker.models.{module}"), cls)
