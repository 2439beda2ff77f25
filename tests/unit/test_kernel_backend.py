"""The kernel backend: chosen once per worker, reached by the layers through the forward context, the spec wherever
its kernel does not apply (for the whole model, decided at load, or for one call), logged once per op and reason."""
from __future__ import annotations

import logging

import pytest
import torch

from pagedserve.kernels import torch_ref
from pagedserve.kernels.backend import KernelBackend
from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.kernels.cpu.backend import CpuBackend
from pagedserve.kernels.select import select_backend
from pagedserve.tests.utils import backend_context
from pagedserve.worker.layers.activation import SiluAndMul
from pagedserve.worker.layers.layernorm import RMSNorm

CPU = torch.device("cpu")
needs_cpp = pytest.mark.skipif(not cpu_extension.available(), reason="no C++ compiler")


def _fallbacks(caplog, op: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f": {op} runs the torch reference" in r.getMessage()]


def test_layers_outside_a_forward_context_say_so():
    with pytest.raises(RuntimeError, match="no forward context"):
        RMSNorm(8)(torch.ones(2, 8))


def test_select_backend_by_name():
    assert type(select_backend("torch", CPU, torch.float32)) is KernelBackend
    with pytest.raises(ValueError, match="unknown attention_backend 'cuda'"):
        select_backend("cuda", CPU, torch.float32)


def test_the_torch_backend_is_the_spec():
    backend = KernelBackend(CPU)
    x, w = torch.randn(3, 10), torch.rand(10) + 0.5
    with backend_context(backend):
        assert torch.equal(RMSNorm(10, 1e-5)(x), torch_ref.rms_norm(x, torch.ones(10), 1e-5))
        assert torch.equal(SiluAndMul()(x), torch_ref.silu_and_mul(x))
    assert torch.equal(backend.rms_norm(x, w, 1e-6), torch_ref.rms_norm(x, w, 1e-6))


@needs_cpp
def test_a_dtype_the_kernels_do_not_take_runs_the_spec_from_load_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="pagedserve.kernels.backend")
    backend = CpuBackend(CPU, torch.float16)
    x, w = torch.randn(4, 16, dtype=torch.float16), torch.rand(16, dtype=torch.float16)
    for _ in range(3):
        assert torch.equal(backend.rms_norm(x, w, 1e-6), torch_ref.rms_norm(x, w, 1e-6))
    assert backend.rms_norm.__func__ is KernelBackend.rms_norm  # decided at load: no check per call
    for op in ("rms_norm", "rotary", "silu_and_mul", "paged_attention", "reshape_and_cache"):
        assert len(_fallbacks(caplog, op)) == 1, op
    assert "float16" in _fallbacks(caplog, "rms_norm")[0]
    assert not _fallbacks(caplog, "argmax")  # sampling works on fp32 logits, whatever the model's dtype


@needs_cpp
def test_one_call_outside_a_kernels_preconditions_runs_the_spec_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="pagedserve.kernels.backend")
    backend = CpuBackend(CPU, torch.float32)
    x = torch.randn(5, 2 * 24)
    strided = x[:, ::2]  # no unit stride along the row: the C++ SiLU-and-mul does not take it
    for _ in range(3):
        torch.testing.assert_close(backend.silu_and_mul(strided), torch_ref.silu_and_mul(strided))
    assert backend.silu_and_mul.__func__ is CpuBackend.silu_and_mul
    [message] = _fallbacks(caplog, "silu_and_mul")
    assert "preconditions" in message and "[5, 24]" in message
    torch.testing.assert_close(backend.silu_and_mul(x), torch_ref.silu_and_mul(x))  # the kernel, no new log
    assert len(_fallbacks(caplog, "silu_and_mul")) == 1
