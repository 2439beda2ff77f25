"""Vocabulary-parallel embedding and LM head; the vocab is padded so it divides the TP size."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.backend import REUSED_OUT_ROWS
from pagedserve.worker.forward_context import current_backend
from pagedserve.worker.models.weights import as_lazy
from pagedserve.worker.parallel_state import LastDimGather, all_reduce, get_tp_rank, get_tp_size


def take_rows(src: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """src[ids] (an embedding lookup, the LM head's rows): on CPU by the kernels' own gather, since torch's is an
    OpenMP region, which waits for a core another process holds (csrc/pool.cpp)."""
    return current_backend().gather_rows(src, ids)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight) -> None:
        w = as_lazy(loaded_weight)
        if w.shape[0] != self.num_embeddings:
            raise ValueError(f"embedding has {w.shape[0]} rows, expected vocab size {self.num_embeddings}")
        n = self.vocab_end - self.vocab_start
        param.data.zero_()
        param.data[:n].copy_(w.narrow(0, self.vocab_start, n).load())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return take_rows(self.weight, input_ids)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        out = take_rows(self.weight, (input_ids - self.vocab_start) * mask)
        return all_reduce(out * mask.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits from a vocab-sharded weight, gathered on every rank and trimmed to the real vocab."""

    packable = True

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.num_embeddings_per_partition), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        self.gather = LastDimGather(REUSED_OUT_ROWS)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 where the bf16 panel GEMM computes them (its fp32 sums, not rounded to bf16 first), else
        in the model dtype; the sampler works on fp32 either way. They are used up before the next call (the model
        runner samples from them, or takes prompt logprobs), so the panel GEMMs, and the gather across TP ranks,
        write into kept buffers."""
        logits = current_backend().linear(self, hidden_states, self.bias, out_dtype=torch.float32, reuse_out=True)
        return self.gather(logits)[..., : self.num_embeddings]
