"""Lazily sliced checkpoint tensors: each TP rank reads only its slice from safetensors."""
from __future__ import annotations

import torch


class LazyWeight:
    """A view of a checkpoint tensor that is read from disk only in :meth:`load`.

    ``source`` is a safetensors slice (``safe_open(...).get_slice(name)``) or a tensor. Narrowing
    and transposing are recorded, then resolved into one slicing read of the source.
    """

    def __init__(self, source, shape: tuple[int, ...] | None = None,
                 offsets: tuple[int, ...] | None = None, transposed: bool = False) -> None:
        self.source = source
        if shape is None:
            shape = tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())
        self.shape = shape  # the shape as seen by the caller (after transpose)
        self.offsets = offsets or (0,) * len(shape)  # in source dims
        self.transposed = transposed

    def _src_dim(self, dim: int) -> int:
        dim %= len(self.shape)
        return (len(self.shape) - 1 - dim) if self.transposed else dim

    def narrow(self, dim: int, start: int, length: int) -> LazyWeight:
        dim %= len(self.shape)
        if start < 0 or start + length > self.shape[dim]:
            raise ValueError(f"narrow [{start}, {start + length}) out of range for dim {dim} of {self.shape}")
        shape = list(self.shape)
        shape[dim] = length
        offsets = list(self.offsets)
        offsets[self._src_dim(dim)] += start
        return LazyWeight(self.source, tuple(shape), tuple(offsets), self.transposed)

    def chunk(self, dim: int, sizes: list[int]) -> list[LazyWeight]:
        out, start = [], 0
        for n in sizes:
            out.append(self.narrow(dim, start, n))
            start += n
        return out

    def t(self) -> LazyWeight:
        if len(self.shape) != 2:
            raise ValueError("t() needs a 2-D weight")
        return LazyWeight(self.source, self.shape[::-1], self.offsets, not self.transposed)

    def load(self) -> torch.Tensor:
        src_shape = self.shape[::-1] if self.transposed else self.shape
        index = tuple(slice(o, o + n) for o, n in zip(self.offsets, src_shape))
        tensor = self.source[index] if index else self.source[...]
        return tensor.t() if self.transposed else tensor


def as_lazy(weight) -> LazyWeight:
    return weight if isinstance(weight, LazyWeight) else LazyWeight(weight)


def default_weight_loader(param: torch.nn.Parameter, loaded_weight) -> None:
    w = as_lazy(loaded_weight)
    if tuple(w.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint shape {tuple(w.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(w.load())
