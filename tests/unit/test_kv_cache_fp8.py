"""The fp8 KV cache's ops: what ``torch_ref`` stores and reads (the spec), the C++ attention reading fp8 caches
against it, and block copies and swaps moving fp8 bytes."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import torch_ref
from pagedserve.kernels.cpu import attention as cpu_attention
from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.kernels.cpu import gemm_bf16 as cpu_gemm_bf16
from pagedserve.tests.utils import cpu_backend, paged_case

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture(scope="module", autouse=True)
def built():
    cpu_extension.load()


def fp8_case(cache_dtype, k_scale, v_scale, q_lens, ctx_lens, gqa, block_size, head_size, dtype, seed, hkv=2):
    """``paged_case`` with its caches quantized: keys of about 3 x the scale's unit, so that scales matter."""
    q, k, v, table, qsl, seq_lens, scale = paged_case(q_lens, ctx_lens, gqa, block_size, head_size, dtype, seed, hkv)
    k8 = torch_ref.quantize_fp8(3 * k_scale * k.float(), k_scale, cache_dtype)
    v8 = torch_ref.quantize_fp8(v_scale * v.float(), v_scale, cache_dtype)
    return q, k8, v8, table, qsl, seq_lens, scale


def test_reference_stores_scaled_saturated_bytes_and_reads_them_back():
    key = torch.tensor([[[1.0, -2.0, 1e5, 1e-5]]])  # [T=1, Hkv=1, D=4]
    for dtype, bound in ((E4M3, 448.0), (E5M2, 57344.0)):
        k_cache = torch.zeros(2, 4, 1, 4, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        torch_ref.reshape_and_cache(key, 1e3 * key, k_cache, v_cache, torch.tensor([5]), k_scale=0.5, v_scale=4.0)
        stored_k, stored_v = k_cache[1, 1, 0].float(), v_cache[1, 1, 0].float()
        assert stored_k.tolist()[:2] == [2.0, -4.0] and stored_k[2] == bound  # 1e5 / 0.5 saturates
        assert stored_v[2] == bound and torch.isfinite(stored_v).all()  # 1e8 / 4 saturates: finite, not inf
        assert torch.equal(torch_ref.dequantize(k_cache[1, 1, 0], 0.5, torch.float32)[:2], key[0, 0, :2])
        assert k_cache[0].view(torch.uint8).eq(0).all()  # only slot 5 written


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("d", [8, 16])  # 16: the 16-lane widening, where the CPU has AVX-512
def test_kernel_widens_every_finite_fp8_code_exactly(cache_dtype, d):
    """One-key sequences whose V rows hold every fp8 code: a one-key softmax is exactly 1, so each output is the
    code's value times v_scale, bit for bit."""
    codes = torch.arange(256, dtype=torch.uint8).view(cache_dtype)
    finite = torch.isfinite(codes.float())
    codes = torch.where(finite, codes.float(), 0.0).to(cache_dtype)
    n = 256 // d
    v_cache = codes.view(n, 1, 1, d)  # n blocks of one slot, one head
    k_cache = torch.zeros_like(v_cache)
    q = torch.randn(n, 1, d)
    table = torch.arange(n, dtype=torch.int32).view(n, 1)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    seq_lens = torch.ones(n, dtype=torch.int32)
    out = cpu_attention.paged_attention(q, k_cache, v_cache, table, qsl, seq_lens, 1.0, v_scale=0.25)
    assert torch.equal(out.view(-1), codes.float() * 0.25)
    assert (codes.float() != 0).sum() > 200 and codes.float().abs().min() == 0


@pytest.mark.parametrize("use_amx", [pytest.param(False, id="avx512"), pytest.param(
    True, id="amx", marks=pytest.mark.skipif(not cpu_gemm_bf16.amx(), reason="no AMX"))])
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("d,gqa", [(32, 1), (64, 2)])  # 2: a decode widens each chunk once for both query heads
def test_bf16_kernels_widen_every_finite_fp8_code_exactly(cache_dtype, use_amx, d, gqa):
    """bf16 queries over an fp8 cache take the bf16 kernels, which widen the cache rows to bf16: every finite code,
    as V rows of d codes, comes out exactly (times v_scale) from a decode row and from a prefill's first row (each
    the only key its row sees, so its weight is exactly 1)."""
    codes = torch.arange(256, dtype=torch.uint8).view(cache_dtype)
    codes = torch.where(torch.isfinite(codes.float()), codes.float(), 0.0).to(cache_dtype)
    n = 256 // d
    v_cache = torch.zeros(2 * n, 1, 1, d, dtype=cache_dtype)
    v_cache[::2, 0, 0] = codes.view(n, d)  # sequence i's first key: block 2i; its second: block 2i + 1 (zeros)
    k_cache = torch.randn(2 * n, 1, 1, d).to(cache_dtype)
    table = torch.arange(2 * n, dtype=torch.int32).view(n, 2)
    q = torch.randn(2 * n, gqa, d).bfloat16()
    for q_lens in ([1] * n, [2] * n):  # decodes of one key; prefills of two rows
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor(q_lens, dtype=torch.int32)
        out = cpu_attention.paged_attention(q[: sum(q_lens)], k_cache, v_cache, table, qsl, seq_lens, 1.0,
                                            v_scale=0.25, use_amx=use_amx)
        for head in range(gqa):
            first_rows = out[qsl[:-1].long(), head].reshape(-1)
            assert torch.equal(first_rows.float(), codes.float() * 0.25)
    assert (codes.float() != 0).sum() > 200


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gqa,head_size,block_size", [(1, 64, 16), (4, 128, 32), (2, 80, 8), (1, 40, 16)])
def test_cpu_attention_over_fp8_matches_reference(cache_dtype, dtype, gqa, head_size, block_size):
    """Decodes at block edges, a decode long enough to run in parts, chunks after a cached prefix, a fresh prompt."""
    case = fp8_case(cache_dtype, 0.5, 2.0, [1, 1, 1, 20, 45, 1], [15, 16, 1300, 33, 0, 0], gqa, block_size,
                    head_size, dtype, seed=gqa + head_size)
    assert cpu_attention.supports(case[0], case[1])
    got = cpu_backend().paged_attention(*case, k_scale=0.5, v_scale=2.0)
    want = torch_ref.paged_attention(case[0].float(), *case[1:], k_scale=0.5, v_scale=2.0)
    assert want.abs().mean() > 0.1
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
def test_cpu_attention_over_fp8_with_window_and_soft_cap(cache_dtype):
    case = fp8_case(cache_dtype, 1.0, 1.0, [1, 30, 1], [40, 10, 700], 2, 64, 16, torch.float32, seed=3)
    for kw in (dict(sliding_window=24), dict(logits_soft_cap=5.0)):
        got = cpu_backend().paged_attention(*case, **kw)
        torch.testing.assert_close(got, torch_ref.paged_attention(*case, **kw), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_reshape_and_cache_writes_the_reference_bytes(cache_dtype, dtype):
    g = torch.Generator().manual_seed(7)
    kv = (torch.finfo(cache_dtype).max / 10 * torch.randn(23, 7, 64, generator=g)).to(dtype)
    key, value = kv[:, :3], kv[:, 4:]  # strided token rows
    slots = torch.randperm(6 * 16, generator=g)[:23]
    slots[[0, 9]] = -1
    caches = [torch.zeros(6, 16, 3, 64, dtype=cache_dtype) for _ in range(4)]
    cpu_backend().reshape_and_cache(key, value, caches[0], caches[1], slots, 0.25, 3.0)
    torch_ref.reshape_and_cache(key, value, caches[2], caches[3], slots, 0.25, 3.0)
    assert caches[0].float().abs().max() == torch.finfo(cache_dtype).max  # some keys saturated
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _rounding_edges(cache_dtype) -> torch.Tensor:
    """Every non-negative finite fp8 value, each midpoint between neighbours (ties, to even) and the floats just
    either side of it, values past the largest, fp32 subnormals, both zeros, the negatives of all; and a NaN."""
    codes = torch.arange(128, dtype=torch.uint8).view(cache_dtype).float()
    values = codes[torch.isfinite(codes)].unique()
    mids = (values[:-1] + values[1:]) / 2
    near = torch.cat([mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(float("inf")))])
    big = torch.tensor([values[-1] * 1.0625, values[-1] * 3, 1e30, 1e-40, 1e-45, 0.0])
    x = torch.cat([values, near, big])
    x = torch.cat([x, -x, torch.tensor([float("nan")])])
    return torch.cat([x, torch.zeros(-len(x) % 64)])  # whole rows of 64


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_reshape_and_cache_rounds_every_edge_as_torch(cache_dtype, dtype):
    """The vector conversion against torch's at every rounding edge of the format (fp32 ties round to even; bf16
    inputs are those values rounded to bf16), subnormals, saturation and a NaN (the group holding it goes through
    torch's scalar conversion)."""
    x = _rounding_edges(cache_dtype).to(dtype).view(-1, 1, 64)
    slots = torch.arange(x.shape[0])
    caches = [torch.zeros(x.shape[0], 1, 1, 64, dtype=cache_dtype) for _ in range(4)]
    cpu_backend().reshape_and_cache(x, x, caches[0], caches[1], slots, 1.0, 0.5)
    torch_ref.reshape_and_cache(x, x, caches[2], caches[3], slots, 1.0, 0.5)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_block_copies_and_swaps_move_fp8_bytes():
    g = torch.Generator().manual_seed(8)
    caches = [torch.randn(6, 16, 2, 8, generator=g).to(E4M3) for _ in range(2)]
    before = [c.clone() for c in caches]
    torch_ref.copy_blocks(caches[:1], caches[1:], torch.tensor([[0, 5], [2, 3]]))
    assert torch.equal(caches[0][5].view(torch.uint8), before[0][0].view(torch.uint8))
    assert torch.equal(caches[1][3].view(torch.uint8), before[1][2].view(torch.uint8))
    host = torch.zeros(4, 16, 2, 8, dtype=E4M3)
    torch_ref.swap_blocks(caches[0], host, torch.tensor([[1, 0], [4, 3]]))
    assert torch.equal(host[3].view(torch.uint8), caches[0][4].view(torch.uint8))
