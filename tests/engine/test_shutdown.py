"""``LLM.shutdown()`` frees an in-process engine's weights and KV cache while the ``LLM`` object lives on (on a GPU a
next engine sizes its cache from the memory left), and the LLM then refuses work with a clear error."""
from __future__ import annotations

import gc
import weakref

import pytest

from pagedserve import LLM, SamplingParams


def test_shutdown_frees_weights_and_kv_cache(llama_dir):
    llm = LLM(llama_dir, device="cpu", dtype="float32", num_gpu_blocks_override=16)
    runner = llm.llm_engine.core.executor.worker.model_runner
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    held = [weakref.ref(next(runner.model.parameters())), weakref.ref(runner.k_caches[0]), weakref.ref(runner.model)]
    del runner
    llm.shutdown()
    gc.collect()
    assert [r() for r in held] == [None, None, None]
    with pytest.raises(RuntimeError, match="was shut down"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    llm.shutdown()  # a second call is harmless
