"""The weight-only int8 GEMM (kernels/cpu/gemm_int8.py) against its spec ``torch_ref.int8_linear`` over odd shapes,
fp32 and bf16 activations; its batch invariance; the quantizer; and int8 linears quantized and packed as a model's
are (the torch reference where not packed)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedserve.kernels import torch_ref
from pagedserve.kernels.cpu import gemm_bf16 as cpu_gemm_bf16
from pagedserve.kernels.cpu import gemm_int8 as cpu_gemm_int8
from pagedserve.tests.utils import cpu_backend
from pagedserve.worker.cpu.packing import pack_linears
from pagedserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.worker.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedserve.worker.layers.quantization import quantize_linears

pytestmark = [pytest.mark.skipif(not cpu_gemm_int8.available(), reason="the C++ kernels do not build here"),
              pytest.mark.usefixtures("cpu_kernels")]  # layers run alone, on the C++ kernels
# fp32 rows: FMA tiles. bf16 rows: FMA tiles and vdpbf16ps, or from 4 rows AMX tiles (an even K) where the CPU has
# AMX.
ACTIVATIONS = [pytest.param(torch.float32, False, id="fp32"), pytest.param(torch.bfloat16, False, id="bf16-avx512"),
               pytest.param(torch.bfloat16, True, id="bf16-amx",
                            marks=pytest.mark.skipif(not cpu_gemm_bf16.amx(), reason="no AMX here"))]


def _case(m: int, k: int, n: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, scale = torch_ref.quantize_int8(torch.randn(n, k, generator=g))
    x = torch.randn(m, k + 5, generator=g).to(dtype)[:, 2:2 + k]  # rows strided, a slice of a wider activation
    bias = torch.randn(n, generator=g).to(dtype)
    return q, scale, x, bias


# M from 1 to 64: decode tiles (1..8 rows), remainders split in two, past the 16 rows where bf16 takes vdpbf16ps;
# N: partial panels, one column, several panels; K: odd, 1, below and past a vector's width; and 300 rows in AMX
# blocks of 128 (K 3073-6144).
@pytest.mark.parametrize("m,k,n", [(1, 17, 33), (2, 1, 5), (3, 64, 31), (8, 129, 100), (9, 96, 1), (13, 300, 37),
                                   (16, 512, 64), (25, 257, 70), (40, 130, 96), (64, 1376, 80), (300, 3500, 40)])
@pytest.mark.parametrize("dtype,use_amx", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch_ref(m, k, n, dtype, bias, use_amx):
    q, scale, x, b = _case(m, k, n, dtype, seed=m * n + k)
    b = b if bias else None
    packed = cpu_gemm_int8.pack_weight(q, scale)
    want = torch_ref.int8_linear(x, q, scale, b, torch.float32).double()
    got32 = cpu_gemm_int8.gemm(x, packed, b, torch.float32, use_amx)
    assert got32.shape == (m, n) and got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, atol=2e-6 * k, rtol=1e-5)  # fp32 sums in another order
    got = cpu_gemm_int8.gemm(x, packed, b, use_amx=use_amx)
    assert got.dtype == dtype
    if dtype == torch.bfloat16:  # one rounding of the fp32 result
        torch.testing.assert_close(got.double(), want, atol=1e-5 * k, rtol=2 ** -8)
        assert (got == want.to(torch.bfloat16)).float().mean() > 0.95
    else:
        torch.testing.assert_close(got, got32)


@pytest.mark.parametrize("dtype,use_amx", ACTIVATIONS)
@pytest.mark.parametrize("k", [640, 650, 3500])
def test_rows_do_not_depend_on_the_batch(dtype, use_amx, k):
    """A row's result is bitwise the same alone and in any batch: FMA tiles, and for bf16 from 7 rows vdpbf16ps,
    which adds each k pair's products in the order the FMA path does. On AMX, batches of 4+ rows (AMX tiles) agree
    with each other, and batches of fewer (FMA tiles) with each other."""
    q, scale, x, _ = _case(260, k, 70, dtype, seed=1)
    w = cpu_gemm_int8.pack_weight(q, scale)

    def gemm(rows: slice) -> torch.Tensor:
        return cpu_gemm_int8.gemm(x[rows], w, out_dtype=torch.float32, use_amx=use_amx)

    batched, few = gemm(slice(0, 260)), torch.cat([gemm(slice(r, r + 3)) for r in range(0, 260, 3)])
    for r in (0, 5, 11, 12, 13, 15, 16, 31, 32, 239, 240, 255, 256, 259):
        assert torch.equal(gemm(slice(r, r + 1)), (few if use_amx else batched)[r:r + 1])
    for rows in (slice(3, 28), slice(0, 16), slice(7, 40), slice(250, 260), slice(100, 104)):
        assert torch.equal(gemm(rows), batched[rows])


def test_batched_shapes_and_zero_rows():
    q, scale, x, _ = _case(6, 32, 24, torch.bfloat16, seed=2)
    w = cpu_gemm_int8.pack_weight(q, scale)
    got = cpu_gemm_int8.gemm(x.reshape(2, 3, 32), w)
    assert got.shape == (2, 3, 24) and torch.equal(got.reshape(6, 24), cpu_gemm_int8.gemm(x, w))
    assert cpu_gemm_int8.gemm(torch.empty(0, 32, dtype=torch.bfloat16), w).shape == (0, 24)
    assert not cpu_gemm_int8.supports(q, torch.float16) and not cpu_gemm_int8.supports(q.float(), torch.float32)


def test_quantize_int8_per_output_channel():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(50, 77, generator=g) * torch.logspace(-3, 2, 50)[:, None]
    w[7] = 0
    q, scale = torch_ref.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (50,)
    assert int(q.abs().amax(1)[torch.arange(50) != 7].min()) == 127  # each row's absmax maps to 127
    assert torch.equal(q[7], torch.zeros(77, dtype=torch.int8)) and scale[7] == 1
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-6)).all())  # round to nearest
    assert torch.equal(torch_ref.quantize_int8(w.bfloat16())[0], torch_ref.quantize_int8(w.bfloat16().float())[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8_panels", [True, False])
def test_quantized_linears_packed_or_reference(dtype, int8_panels, caplog):
    """quantize_linears turns the linears' weights, the tied LM head's included, into int8 + fp32 scales, leaving
    the embedding the head is tied to; pack_linears puts them in int8 panels (freeing the int8 weight) or, without,
    they run the torch reference: same results."""
    qkv = QKVParallelLinear(64, 16, 4, 2, bias=True)
    row = RowParallelLinear(128, 64, bias=True)
    embedding = VocabParallelEmbedding(300, 64)
    head = ParallelLMHead(300, 64)
    head.tie_to(embedding)
    model = nn.ModuleList([qkv, row, embedding, head]).to(dtype)
    g = torch.Generator().manual_seed(5)
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=g).to(dtype)
    full = {m: m.weight.detach().clone() for m in (qkv, row, head)}
    with caplog.at_level("INFO", logger="pagedserve.worker.layers.quantization"):
        assert quantize_linears(model, "int8") == 3
    kept = full[head].numel() * full[head].element_size() / 2**20  # not freed: the embedding still holds it
    assert f"the tied embedding keeps its {kept:.1f} MiB" in caplog.text
    assert embedding.weight.dtype == dtype and torch.equal(embedding.weight, full[head])
    for m in (qkv, row, head):
        assert m.weight.dtype == torch.int8 and m.weight_scale.shape == (m.weight.shape[0],)
        q, scale = torch_ref.quantize_int8(full[m])
        assert torch.equal(m.weight, q) and torch.equal(m.weight_scale, scale)
    xs = {qkv: torch.randn(7, 64, generator=g).to(dtype), row: torch.randn(7, 128, generator=g).to(dtype),
          head: torch.randn(7, 64, generator=g).to(dtype)}
    want = {m: torch_ref.int8_linear(xs[m], m.weight, m.weight_scale, m.bias) for m in (qkv, row)}
    want[head] = torch_ref.int8_linear(xs[head], head.weight, head.weight_scale, out_dtype=torch.float32)
    ids = torch.tensor([0, 5, 299])
    pack_linears(model, int8_panels=int8_panels)
    assert torch.equal(embedding(ids), full[head][ids])
    for m in (qkv, row, head):
        packed = isinstance(getattr(m, "panel_weight", None), cpu_gemm_int8.Int8PanelWeight)
        assert packed == int8_panels and (m.weight.numel() == 0) == int8_panels
        got = head.compute_logits(xs[m]) if m is head else cpu_backend().linear(m, xs[m], m.bias)
        assert got.dtype == (torch.float32 if m is head else dtype)
        torch.testing.assert_close(got.float(), want[m].float(), atol=1e-5 * 128, rtol=2 ** -7)


def test_column_parallel_without_bias():
    lin = ColumnParallelLinear(40, 50, bias=False)
    lin.weight.data = torch.randn(50, 40)
    quantize_linears(nn.ModuleList([lin]), "int8")
    x = torch.randn(3, 40)
    want = torch_ref.int8_linear(x, lin.weight, lin.weight_scale)
    pack_linears(nn.ModuleList([lin]))
    torch.testing.assert_close(cpu_backend().linear(lin, x, None), want, atol=1e-4, rtol=1e-5)
