"""Phi3ForCausalLM: LLaMA's layers, with q/k/v and gate/up fused in the checkpoint and LongRoPE scaling."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from pagedserve.common.config import AttentionShape
from pagedserve.worker.models.llama import LlamaForCausalLM
from pagedserve.worker.models.weights import as_lazy


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config) -> None:
        super().__init__(config)
        shape = AttentionShape.of(config)
        heads, kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_size
        self.qkv_sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        self.gate_up_sizes = [config.intermediate_size] * 2

    def _unfuse(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        """Each fused tensor as its q/k/v (gate/up) parts, lazily: the stacked loaders then read only their rank's
        rows of each part."""
        for name, w in weights:
            if ".qkv_proj." in name:
                for part, piece in zip(("q_proj", "k_proj", "v_proj"), as_lazy(w).chunk(0, self.qkv_sizes)):
                    yield name.replace(".qkv_proj.", f".{part}."), piece
            elif ".gate_up_proj." in name:
                for part, piece in zip(("gate_proj", "up_proj"), as_lazy(w).chunk(0, self.gate_up_sizes)):
                    yield name.replace(".gate_up_proj.", f".{part}."), piece
            else:
                yield name, w

    def load_weights(self, weights) -> None:
        super().load_weights(self._unfuse(weights))
