"""What the engine will allocate on a node, from the config and the checkpoint's headers before any worker starts:
the weights, and the KV cache sized as the workers size it (``Worker.determine_num_blocks``)."""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import psutil
import torch

from pagedserve.common.config import AttentionShape, EngineConfig
from pagedserve.kernels.select import kv_cache_dtype
from pagedserve.worker.worker import configured_kv_blocks, cpu_kv_blocks

_CGROUP_MAX, _CGROUP_CURRENT = "/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"


@dataclass
class MemoryPlan:
    device: str
    weight_bytes: int  # this node's share: the whole model on CPU (all TP ranks on one node), 1/tp of it per GPU
    kv_bytes: int  # the KV cache the engine will allocate, over the ranks sharing ``available_bytes``
    available_bytes: int
    kv_tokens: int  # tokens a rank's KV cache holds
    max_model_len: int


def weight_bytes(config: EngineConfig) -> int:
    """The model's parameters in the dtype it runs in, from the safetensors headers (no tensor is read)."""
    numel = 0
    for path in config.model_config.weight_files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        numel += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return numel * config.model_config.dtype.itemsize


def kv_bytes_per_block(config: EngineConfig) -> int:
    """A rank's KV bytes per block, as ``ModelRunner.kv_bytes_per_block`` counts them once the model is built."""
    hf, tp = config.model_config.hf_config, config.parallel_config.tensor_parallel_size
    shape = AttentionShape.of(hf)
    dtype = kv_cache_dtype(config.cache_config.cache_dtype, config.model_config.dtype)
    return (2 * hf.num_hidden_layers * config.cache_config.block_size * shape.kv_heads_per_rank(tp) * shape.head_size
            * dtype.itemsize)


def available_memory() -> int:
    """Available RAM, within this container's cgroup limit when it has one."""
    available = psutil.virtual_memory().available
    try:
        with open(_CGROUP_MAX) as f:
            limit = f.read().strip()
        with open(_CGROUP_CURRENT) as f:
            used = int(f.read())
    except (OSError, ValueError):
        return available
    return available if limit == "max" else min(available, int(limit) - used)


def memory_plan(config: EngineConfig) -> MemoryPlan:
    """What the engine will allocate on this node, as the workers size it (``Worker.determine_num_blocks``)."""
    cc, sc = config.cache_config, config.scheduler_config
    tp = config.parallel_config.tensor_parallel_size
    per_block = kv_bytes_per_block(config)
    weights = weight_bytes(config)
    if config.device == "cuda":
        free, total = torch.cuda.mem_get_info()
        weights = weights // tp
        available = min(free, int(total * cc.gpu_memory_utilization))
        ranks = 1
        default_kv = max(available - weights, 0)  # profiled: what is left after the weights (and activations)
    else:
        available, ranks = available_memory(), tp
        default_kv = cpu_kv_blocks(max(available - weights, 0), per_block, cc, sc) * per_block
    configured = configured_kv_blocks(cc, per_block)
    kv = default_kv if configured is None else configured * per_block
    return MemoryPlan(config.device, weights, kv * ranks, available, kv // per_block * cc.block_size,
                      sc.max_model_len)
