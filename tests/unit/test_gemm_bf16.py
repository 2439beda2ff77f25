"""The AVX512-BF16 panel GEMM (kernels/cpu/gemm_bf16.py) and its AMX tiles against a float64 matmul of the same
bf16 inputs, their batch invariance, and bf16 linears packed for them. Skipped, saying so, on CPUs without
AVX512-BF16 (the AMX cases on CPUs without AMX)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.backend import REUSED_OUT_ROWS
from pagedserve.kernels.cpu import gemm_bf16 as cpu_gemm_bf16
from pagedserve.tests.utils import cpu_backend
from pagedserve.worker.cpu.packing import pack_linears
from pagedserve.worker.layers.embedding import ParallelLMHead
from pagedserve.worker.layers.linear import ColumnParallelLinear, RowParallelLinear

pytestmark = [pytest.mark.skipif(not cpu_gemm_bf16.available(), reason="no AVX512-BF16 on this CPU"),
              pytest.mark.usefixtures("cpu_kernels")]  # layers run alone, on the C++ kernels
KERNELS = [pytest.param(False, id="avx512"),
           pytest.param(True, id="amx", marks=pytest.mark.skipif(not cpu_gemm_bf16.amx(), reason="no AMX here"))]


def _bf16(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


def _exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x.double() @ w.double().T + (b.double() if b is not None else 0)


# Rows: one tile, a 13-row remainder (7 + 6; AMX: one short tile), past a 240-row block (AMX: 256; 128 where K is
# 3073-6144), two A tiles and a short third; K: whole AMX k steps or not (300, 30, 2); N: partial panels (37: one and
# a half; 48: the second half of a panel empty) and several panels per thread.
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (13, 300, 37), (25, 512, 1536), (251, 1376, 80), (40, 30, 33),
                                   (3, 2, 5), (300, 96, 64), (300, 3500, 40)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("use_amx", KERNELS)
def test_matches_float64_matmul(m, k, n, bias, use_amx):
    g = torch.Generator().manual_seed(m * n)
    w, b = _bf16(n, k, gen=g), _bf16(n, gen=g) if bias else None
    x = _bf16(m, k + 6, gen=g)[:, 2:2 + k]  # rows strided, as a slice of a wider activation
    want = _exact(x, w, b)
    packed = cpu_gemm_bf16.pack_weight(w)
    got32 = cpu_gemm_bf16.gemm(x, packed, b, torch.float32, use_amx)
    assert got32.shape == (m, n) and got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, atol=2e-6 * k, rtol=1e-5)  # fp32 sums of exact products
    got16 = cpu_gemm_bf16.gemm(x, packed, b, use_amx=use_amx)
    assert got16.dtype == torch.bfloat16
    # One rounding of the fp32 sum: within one bf16 ulp of the exact result (2^-8 relative), nearly always equal
    # to the exact result rounded.
    torch.testing.assert_close(got16.double(), want, atol=1e-5 * k, rtol=2 ** -8)
    assert (got16 == want.to(torch.bfloat16)).float().mean() > 0.95


@pytest.mark.parametrize("k", [640, 650, 3500])
@pytest.mark.parametrize("use_amx", KERNELS)
def test_rows_do_not_depend_on_the_batch(k, use_amx):
    """Each output is summed in k order whatever tile its row lands in (full or short, read in place or from the
    padded copy): a row's result is bitwise the same alone and in any batch."""
    g = torch.Generator().manual_seed(1)
    w = cpu_gemm_bf16.pack_weight(_bf16(70, k, gen=g))
    x = _bf16(260, k, gen=g)
    batched = cpu_gemm_bf16.gemm(x, w, use_amx=use_amx)
    for r in (0, 5, 11, 12, 13, 15, 16, 31, 32, 239, 240, 255, 256, 259):
        assert torch.equal(cpu_gemm_bf16.gemm(x[r:r + 1], w, use_amx=use_amx), batched[r:r + 1])
    for rows in (slice(3, 28), slice(0, 16), slice(7, 40), slice(250, 260)):
        assert torch.equal(cpu_gemm_bf16.gemm(x[rows], w, use_amx=use_amx), batched[rows])


def test_batched_shapes_zero_rows_and_odd_k():
    g = torch.Generator().manual_seed(2)
    w = _bf16(24, 32, gen=g)
    packed = cpu_gemm_bf16.pack_weight(w)
    x = _bf16(2, 3, 32, gen=g)
    torch.testing.assert_close(cpu_gemm_bf16.gemm(x, packed, out_dtype=torch.float32).double(),
                               _exact(x.reshape(6, 32), w, None).view(2, 3, 24), atol=1e-4, rtol=1e-5)
    assert cpu_gemm_bf16.gemm(torch.empty(0, 32, dtype=torch.bfloat16), packed).shape == (0, 24)
    assert not cpu_gemm_bf16.packable(_bf16(8, 31, gen=g)) and not cpu_gemm_bf16.packable(torch.randn(8, 32))


def test_packed_bf16_linears_and_lm_head():
    """pack_linears gives bf16 weights k-pair panels (one huge-page buffer); layers match F.linear within bf16
    rounding, and the LM head returns fp32 logits (not rounded to bf16 first)."""
    col, row = ColumnParallelLinear(64, 96, bias=True), RowParallelLinear(96, 64, bias=True)
    head = ParallelLMHead(1000, 64)
    model = nn.ModuleList([col, row, head])
    g = torch.Generator().manual_seed(3)
    for p in model.parameters():
        p.data = _bf16(*p.shape, gen=g)
    x = _bf16(5, 64, gen=g)
    want_hidden = F.linear(F.linear(x, col.weight, col.bias), row.weight) + row.bias
    head_weight = head.weight.detach().clone()  # packing frees the plain weight
    assert pack_linears(model) == 3
    assert all(isinstance(m.panel_weight, cpu_gemm_bf16.BF16PanelWeight) for m in model)
    assert len({m.panel_weight.panels.untyped_storage().data_ptr() for m in model}) == 1
    hidden = row(col(x))
    assert hidden.dtype == torch.bfloat16
    torch.testing.assert_close(hidden.float(), want_hidden.float(), atol=0.1, rtol=2e-2)
    logits = head.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (5, 1000)
    torch.testing.assert_close(logits.double(), _exact(hidden, head_weight, None), atol=1e-4, rtol=1e-5)
    # Up to REUSED_OUT_ROWS rows, logits land in a buffer the head keeps: the next call writes over them.
    again = head.compute_logits(hidden[:3])
    assert again.data_ptr() == logits.data_ptr()
    torch.testing.assert_close(again.double(), _exact(hidden[:3], head_weight, None), atol=1e-4, rtol=1e-5)
    many = _bf16(REUSED_OUT_ROWS + 1, 64, gen=g)
    fresh = head.compute_logits(many)
    assert fresh.data_ptr() != logits.data_ptr() and fresh.shape == (REUSED_OUT_ROWS + 1, 1000)
    torch.testing.assert_close(fresh.double(), _exact(many, head_weight, None), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        cpu_gemm_bf16.gemm(hidden, head.panel_weight, out=torch.empty(5, 999))


def test_oneDNN_layout_without_bf16_panels():
    lin = ColumnParallelLinear(64, 32, bias=False)
    lin.weight.data = torch.randn(32, 64).to(torch.bfloat16)
    want = F.linear(torch.ones(2, 64, dtype=torch.bfloat16), lin.weight)
    assert pack_linears(nn.ModuleList([lin]), bf16_panels=False) == 1
    assert getattr(lin, "panel_weight", None) is None and lin.packed_weight is not None
    torch.testing.assert_close(cpu_backend().linear(lin, torch.ones(2, 64, dtype=torch.bfloat16), None), want)
