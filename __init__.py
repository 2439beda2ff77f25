"""pagedserve: distributed, tensor-parallel LLM serving with a paged KV cache.

The offline API is exported here, as vLLM's is. Exports load on first use, so that the light parts (the gRPC
client, ``pagedserve health``) import without torch or Ray.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": "pagedserve.engine.llm",
    "LLMEngine": "pagedserve.engine.llm_engine",
    "EngineArgs": "pagedserve.engine.arg_utils",
    "SamplingParams": "pagedserve.sampling_params",
    "BeamSearchParams": "pagedserve.sampling_params",
    "RequestOutput": "pagedserve.outputs",
    "CompletionOutput": "pagedserve.outputs",
    "Logprob": "pagedserve.outputs",
    "BeamSearchOutput": "pagedserve.outputs",
    "BeamSearchSequence": "pagedserve.outputs",
}
__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
    from pagedserve.sampling_params import BeamSearchParams, SamplingParams


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
