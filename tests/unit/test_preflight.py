"""The preflight's KV-cache sizing (``cluster/runtime/memory_plan.py``), computed from the config before any worker
starts, is the workers' own: the same bytes per block as the model runner counts from the built layers (every
architecture, one rank of a TP group, an fp8 cache), and the same number of blocks as ``Worker.determine_num_blocks``
gives for the same free memory."""
from __future__ import annotations

import pytest
import torch

from pagedserve.cluster.runtime import memory_plan
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.tests.utils import ARCHS
from pagedserve.worker import parallel_state, worker
from pagedserve.worker.model_runner import ModelRunner

CPU = torch.device("cpu")


@pytest.mark.parametrize("arch, tp, cache_dtype", [*((a, 1, "auto") for a in ARCHS), ("llama-gqa8", 2, "auto"),
                                                   ("llama-gqa8", 4, "auto"), ("llama", 4, "auto"),
                                                   ("qwen3", 1, "fp8")])
def test_kv_bytes_per_block_are_the_runners(model_factory, monkeypatch, arch, tp, cache_dtype):
    config = EngineArgs(model=model_factory(arch), dtype="float32", tensor_parallel_size=tp,
                        kv_cache_dtype=cache_dtype, attention_backend="torch").create_engine_config()
    monkeypatch.setattr(parallel_state, "_TP_RANK", tp - 1)
    monkeypatch.setattr(parallel_state, "_TP_SIZE", tp)
    assert memory_plan.kv_bytes_per_block(config) == ModelRunner(config, CPU).kv_bytes_per_block()


@pytest.mark.parametrize("flags", [{}, {"max_num_seqs": 2, "max_model_len": 64}, {"kv_cache_memory": 1 << 20},
                                   {"num_gpu_blocks_override": 7}])
def test_the_memory_plans_blocks_are_the_workers(llama_dir, monkeypatch, flags):
    config = EngineArgs(model=llama_dir, dtype="float32", attention_backend="torch", **flags).create_engine_config()
    free_after_load = 3 << 30
    monkeypatch.setattr(memory_plan, "available_memory", lambda: free_after_load + memory_plan.weight_bytes(config))
    monkeypatch.setattr(worker.psutil, "virtual_memory", lambda: type("Mem", (), {"available": free_after_load}))
    plan = memory_plan.memory_plan(config)
    blocks = worker.Worker(config).determine_num_blocks()
    assert plan.kv_tokens == blocks * config.cache_config.block_size
