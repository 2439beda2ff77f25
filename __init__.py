"""pagedserve: distributed, tensor-parallel LLM serving with a paged KV cache.

The offline API and the gRPC clients are exported here, as vLLM's are. Exports load on first use, so that the light
parts (the gRPC client, ``pagedserve health``) import without torch or Ray.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING

_EXPORTS = {
    "Client": "pagedserve.cluster.client",
    "AsyncClient": "pagedserve.cluster.client",
    "LLM": "pagedserve.engine.llm",
    "LLMEngine": "pagedserve.engine.llm_engine",
    "EngineArgs": "pagedserve.engine.arg_utils",
    "SamplingParams": "pagedserve.common.sampling_params",
    "BeamSearchParams": "pagedserve.common.sampling_params",
    "RequestOutput": "pagedserve.common.outputs",
    "CompletionOutput": "pagedserve.common.outputs",
    "Logprob": "pagedserve.common.outputs",
    "BeamSearchOutput": "pagedserve.common.outputs",
    "BeamSearchSequence": "pagedserve.common.outputs",
}
__all__ = [
    "LLM",
    "AsyncClient",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "Client",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from pagedserve.cluster.client import AsyncClient, Client
    from pagedserve.common.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
    from pagedserve.common.sampling_params import BeamSearchParams, SamplingParams
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.llm_engine import LLMEngine


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def _yield_top_level_name(name: str) -> None:
    """Called by each of this package's top-level folders when it is being imported as the top-level ``name``
    rather than as ``pagedserve.name`` (the checkout root is on ``sys.path``: a shell or ``python -c`` in the
    checkout, ``python -m``, a Ray worker started there). The name goes to the module of that name found on the rest
    of ``sys.path`` (Hugging Face's ``kernels`` for ``kernels``), which the import machinery then returns; with
    none, the folder stays an empty package with no ``__file__``, as a PEP 420 namespace portion would be, which
    ``find_spec``-then-import availability checks (``transformers``') read as "not installed". The root skipped is
    the folder's own (any checkout, not only the installed one)."""
    ours = sys.modules[name]
    root = os.path.dirname(os.path.dirname(os.path.realpath(ours.__file__)))
    removed = [(i, p) for i, p in enumerate(sys.path) if os.path.realpath(p or os.curdir) == root]
    for i, _ in reversed(removed):
        del sys.path[i]
    del sys.modules[name]
    try:
        importlib.import_module(name)  # sys.modules[name] is now the other module
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        ours.__file__ = None
        sys.modules[name] = ours
    finally:
        for i, p in removed:
            sys.path.insert(i, p)
