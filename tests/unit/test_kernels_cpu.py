"""The C++ CPU kernels against the torch reference: attention (decodes and prefill chunks, fp32 and bf16), fused
RMSNorm / SiLU-and-mul / rotary / KV writes, the fp32 panel GEMM, and packed linears (panels and oneDNN). bf16
results are checked against the reference computed in fp32 from the same bf16 inputs, with bf16 tolerances."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import torch_ref
from pagedserve.kernels.cpu import attention as cpu_attention
from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.kernels.cpu import fused as cpu_fused
from pagedserve.kernels.cpu import gemm as cpu_gemm
from pagedserve.kernels.cpu import gemm_bf16 as cpu_gemm_bf16
from pagedserve.tests.utils import cpu_backend, paged_case
from pagedserve.worker.cpu.hugepages import HUGE_PAGE, zeros_huge_pages
from pagedserve.worker.cpu.packing import pack_linears, panel_gemm_preferred
from pagedserve.worker.layers.layernorm import RMSNorm
from pagedserve.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.worker.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # layers run alone, on the C++ kernels

BF16_TOL = dict(atol=2e-2, rtol=2e-2)  # a few bf16 ulps (2^-8 relative) on values of order 1
FP32_TOL = dict(atol=2e-5, rtol=1e-5)
# bf16 prefill rows: on vdpbf16ps, and on AMX tiles where this CPU has them.
PREFILL_KERNELS = [pytest.param(False, id="avx512"),
                   pytest.param(True, id="amx", marks=pytest.mark.skipif(not cpu_gemm_bf16.amx(), reason="no AMX"))]


@pytest.fixture(scope="module", autouse=True)
def built():
    cpu_extension.load()  # a failed build fails here with the compiler's error


def reference_fp32(q, k, v, table, qsl, seq_lens, scale):
    return torch_ref.paged_attention(q.float(), k.float(), v.float(), table, qsl, seq_lens, scale)


# Decodes at block edges, a fresh prefill, chunks after a cached prefix, one longer than a 32-row tile.
Q_LENS = [1, 1, 1, 1, 7, 20, 1, 45, 1]
CTX_LENS = [0, 15, 16, 47, 0, 33, 76, 9, 200]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gqa", [1, 2, 4])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 128])
def test_attention_matches_reference(dtype, gqa, block_size, head_size):
    case = paged_case(Q_LENS, CTX_LENS, gqa, block_size, head_size, dtype, seed=gqa * 1000 + block_size + head_size)
    got = cpu_attention.paged_attention(*case)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), reference_fp32(*case), **(FP32_TOL if dtype == torch.float32 else BF16_TOL))


@pytest.mark.parametrize("use_amx", PREFILL_KERNELS)
@pytest.mark.parametrize("gqa,head_size,block_size", [(1, 64, 16), (4, 128, 8), (2, 32, 32), (7, 64, 16),
                                                      (4, 96, 16), (1, 256, 16)])
def test_bf16_attention_long_prefills(gqa, head_size, block_size, use_amx):
    """Past the bf16 kernel's 128-query-vector items and 16-vector tiles: prompts of 150 and 300 rows (one after a
    long cached prefix), odd key counts, short prompts, beside decodes with 1 and 700 keys; GQA groups that split
    rows across tiles (7), head sizes of one to eight 32-element steps."""
    case = paged_case([150, 1, 37, 300, 1, 5, 2], [0, 700, 17, 211, 0, 3, 40], gqa, block_size, head_size,
                      torch.bfloat16, seed=gqa + head_size)
    want = reference_fp32(*case)
    assert want.abs().mean() > 0.1  # outputs well above the tolerance: errors of 8e-3 at most were measured
    got = cpu_attention.paged_attention(*case, use_amx=use_amx).float()
    torch.testing.assert_close(got, want, atol=1e-2, rtol=2e-2)


@pytest.mark.parametrize("use_amx", PREFILL_KERNELS)
@pytest.mark.parametrize("gqa,head_size", [(1, 64), (7, 64), (4, 128)])
def test_bf16_prefill_rows_do_not_depend_on_the_batch_or_the_chunking(gqa, head_size, use_amx):
    """A prompt's rows are bitwise the same prefilled alone, beside other sequences, and as a later chunk after
    its first rows are cached: every sum runs over the same key steps from key 0, whatever tile a row lands in."""
    case = paged_case([300, 37, 1, 150], [0, 17, 90, 0], gqa, 16, head_size, torch.bfloat16, seed=gqa + head_size)
    q, k, v, table, qsl, seq_lens, scale = case
    batch = cpu_attention.paged_attention(*case, use_amx=use_amx)
    alone = cpu_attention.paged_attention(q[:300], k, v, table[:1], qsl[:2], seq_lens[:1], scale, use_amx=use_amx)
    assert torch.equal(alone, batch[:300])
    for first in (170, 7, 299):  # rows [first, 300) as the chunk after [0, first)
        chunk = cpu_attention.paged_attention(q[first:300], k, v, table[:1], torch.tensor([0, 300 - first]).int(),
                                              seq_lens[:1], scale, use_amx=use_amx)
        assert torch.equal(chunk, alone[first:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# hkv 8 x 128: KV rows of 1024 elements, 96 KB in flight, prefetched into L2 (bf16) on any L1D; the others into L1
@pytest.mark.parametrize("gqa,head_size,block_size,hkv", [(1, 64, 16, 2), (4, 128, 32, 2), (2, 96, 8, 2),
                                                          (1, 128, 16, 8)])
def test_decodes_in_parts_match_and_do_not_depend_on_the_batch(dtype, gqa, head_size, block_size, hkv):
    """Decode rows of more than 512 keys run in parts on both threads and merge: the result matches the fp32
    reference, and each row's is bitwise the same alone and in a batch (the parts follow its length only)."""
    ctx = [512, 513, 3000, 40, 1023, 1300]  # one part, just over, many, short, odd ends
    case = paged_case([1] * len(ctx), [c - 1 for c in ctx], gqa, block_size, head_size, dtype,
                      seed=gqa + head_size + block_size, hkv=hkv)
    q, k, v, table, qsl, seq_lens, scale = case
    got = cpu_attention.paged_attention(*case)
    tol = FP32_TOL if dtype == torch.float32 else dict(atol=1e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), reference_fp32(*case), **tol)
    for i in range(len(ctx)):
        alone = cpu_attention.paged_attention(q[i:i + 1], k, v, table[i:i + 1], qsl[:2], seq_lens[i:i + 1], scale)
        assert torch.equal(alone, got[i:i + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reads_strided_queries(dtype):
    """Queries as a column slice of a fused QKV output: rows strided, heads packed."""
    q, k, v, table, qsl, seq_lens, scale = paged_case([3, 1, 12], [5, 30, 0], 2, 16, 64, dtype, seed=3)
    qkv = torch.randn(q.shape[0], q.shape[1] * 64 + 2 * 2 * 64).to(dtype)
    qkv[:, : q.shape[1] * 64] = q.reshape(q.shape[0], -1)
    view = qkv[:, : q.shape[1] * 64].view(-1, q.shape[1], 64)
    assert not view.is_contiguous()
    got = cpu_attention.paged_attention(view, k, v, table, qsl, seq_lens, scale)
    torch.testing.assert_close(got.float(), reference_fp32(q, k, v, table, qsl, seq_lens, scale),
                               **(FP32_TOL if dtype == torch.float32 else BF16_TOL))


def test_backend_routes_by_dtype():
    """fp32 and bf16 through the kernel; fp16 (not in the kernel) through the torch reference, same result."""
    backend = cpu_backend()
    for dtype, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL), (torch.float16, dict(atol=4e-3,
                                                                                                  rtol=4e-3))):
        case = paged_case([1, 20, 1], [39, 0, 32], 2, 16, 64, dtype, seed=7)
        got = backend.paged_attention(*case)
        torch.testing.assert_close(got.float(), reference_fp32(*case), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_skips_padding_and_reads_strided_rows(dtype):
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(6, 2 * 2 * 64, generator=g).to(dtype)
    key, value = kv[:, :128].view(6, 2, 64), kv[:, 128:].view(6, 2, 64)
    slots = torch.tensor([5, -1, 17, 0, -1, 31])
    caches = [torch.zeros(2, 16, 2, 64, dtype=dtype) for _ in range(4)]
    cpu_backend().reshape_and_cache(key, value, caches[0], caches[1], slots)
    torch_ref.reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]) and caches[0].any()


def _rms_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [96, 104])  # 16-lane steps only, and with an 8-lane tail
def test_rms_norm_and_fused_residual(dtype, hidden):
    g = torch.Generator().manual_seed(1)
    x, res = torch.randn(37, hidden, generator=g).to(dtype), torch.randn(37, hidden, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(cpu_fused.rms_norm(x, w, 1e-6).float(), _rms_reference(x, w, 1e-6), **tol)
    total = x.float() + res.float()
    xx, rr = x.clone(), res.clone()
    cpu_fused.fused_add_rms_norm(xx, rr, w, 1e-6)
    torch.testing.assert_close(rr.float(), total, **tol)
    torch.testing.assert_close(xx.float(), _rms_reference(total, w, 1e-6), **tol)


def test_rms_norm_layer_fp32_is_the_torch_path():
    """The layer's C++ path and the spec agree to fp32 rounding, with and without a residual."""
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.randn(64)
    x, res = torch.randn(9, 64), torch.randn(9, 64)
    torch.testing.assert_close(norm(x), torch_ref.rms_norm(x, norm.weight, 1e-5), **FP32_TOL)
    want_res = x + res
    got, got_res = norm(x.clone(), res.clone())
    torch.testing.assert_close(got_res, want_res, **FP32_TOL)
    torch.testing.assert_close(got, torch_ref.rms_norm(want_res, norm.weight, 1e-5), **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    x = (4 * torch.randn(23, 2 * 200, generator=torch.Generator().manual_seed(2))).to(dtype)
    edge = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0, 3.0]).to(dtype)  # exp's clamped range
    x[0, :8] = edge  # in a 16-lane step
    x[1, 192:200] = edge  # in the 8-lane tail (200 = 12 * 16 + 8)
    want = F.silu(x.float()[:, :200]) * x.float()[:, 200:]
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(cpu_fused.silu_and_mul(x).float(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [64, 16, 4])
def test_rotary_in_place_on_strided_heads(dtype, rotary_dim):
    """GPT-NeoX hands q and k as strided views of a per-head [q, k, v] buffer; partial rotary leaves the rest."""
    rope = RotaryEmbedding(64, rotary_dim, 512, 10000.0)
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(11, 4, 3, 64, generator=g).to(dtype)
    positions = torch.randint(0, 512, (11,), generator=g)
    want_q, want_k = torch_ref.rotary(positions, qkv[:, :, 0].float(), qkv[:, :, 1].float(), rope.cos, rope.sin,
                                      rotary_dim)
    v_before = qkv[:, :, 2].clone()
    q, k = rope(positions, qkv[:, :, 0], qkv[:, :, 1])
    assert q.data_ptr() == qkv.data_ptr()  # in place
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(q.float(), want_q, **tol)
    torch.testing.assert_close(k.float(), want_k, **tol)
    assert torch.equal(qkv[:, :, 2], v_before)


# Rows: one tile, a partial tile, and past a 192-row block; K: past a 256-wide k block; N: a partial panel.
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (7, 300, 37), (13, 512, 1536), (200, 600, 80)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_gemm_matches_matmul(m, k, n, bias):
    w, b = torch.randn(n, k), torch.randn(n) if bias else None
    x = torch.randn(m, k + 5)[:, 3:3 + k]  # rows strided, as a slice of a wider activation
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    got = cpu_gemm.gemm(x, cpu_gemm.pack_weight(w), b)
    assert got.shape == (m, n)
    torch.testing.assert_close(got.double(), want, atol=1e-4 * k ** 0.5, rtol=1e-5)


def test_panel_gemm_rows_do_not_depend_on_the_batch():
    """Each output element is summed in k order whatever tile its row lands in, so a row's result is bitwise the
    same alone and in any batch (decode results do not change with what else is running)."""
    w = cpu_gemm.pack_weight(torch.randn(40, 600))
    x = torch.randn(200, 600)
    batched = cpu_gemm.gemm(x, w)
    for r in (0, 5, 6, 7, 11, 12, 13, 23, 24, 199):  # either side of the 6-row (AVX2) and 12-row (AVX-512) tiles
        assert torch.equal(cpu_gemm.gemm(x[r:r + 1], w), batched[r:r + 1])
    assert torch.equal(cpu_gemm.gemm(x[3:16], w), batched[3:16])
    assert torch.equal(cpu_gemm.gemm(x[5:30], w), batched[5:30])


def test_panel_gemm_takes_batched_shapes_and_zero_rows():
    w = cpu_gemm.pack_weight(torch.randn(24, 32))
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(cpu_gemm.gemm(x, w), x @ w.panels.transpose(1, 2).reshape(-1, 32)[:24].T)
    assert cpu_gemm.gemm(torch.randn(0, 32), w).shape == (0, 24)


def test_panel_gemm_preferred_by_cpu_flags():
    assert panel_gemm_preferred({"avx2", "fma"}) and panel_gemm_preferred({"avx2", "fma", "avx512f"})
    assert not panel_gemm_preferred({"avx2", "fma", "avx512f", "avx512_bf16"})
    assert not panel_gemm_preferred({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"})
    assert not panel_gemm_preferred({"sse4_2"})


@pytest.mark.parametrize("panels", [True, False])
def test_packed_linears_match_f_linear_and_keep_tied_weights(panels):
    col, row = ColumnParallelLinear(64, 96, bias=True), RowParallelLinear(96, 64, bias=True)
    model = nn.ModuleList([col, row])
    for p in model.parameters():
        p.data = torch.randn(p.shape)
    x = torch.randn(5, 64)
    want = F.linear(F.linear(x, col.weight, col.bias), row.weight) + row.bias
    tied = ColumnParallelLinear(64, 96, bias=False)
    tied.weight = col.weight  # shared with col: neither may drop it, and one packed copy serves both
    model.append(tied)
    assert pack_linears(model, panels=panels) == 3
    attr = "panel_weight" if panels else "packed_weight"
    assert row.weight.numel() == 0 and getattr(row, attr) is not None and col.weight.numel() == 96 * 64
    assert getattr(tied, attr) is getattr(col, attr) and tied.weight is col.weight
    torch.testing.assert_close(row(col(x)), want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(cpu_backend().linear(tied, x, None), F.linear(x, col.weight), atol=1e-4, rtol=1e-5)


def _anon_huge_kib(addr: int) -> int:
    """AnonHugePages of the mapping holding ``addr`` in this process, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def _thp_enabled() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


# 34-69 MiB: above glibc's largest mmap threshold (32 MiB), so a fresh mapping; 320 KiB: an ordinary tensor.
@pytest.mark.parametrize("blocks", [1100, 10])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_tensors_are_zeroed_and_on_huge_pages(dtype, blocks):
    shape = (blocks, 16, 8, 64)
    t = zeros_huge_pages(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()
    t[-1, -1, -1, -1] = 1  # the whole range is writable
    nbytes = t.numel() * t.element_size()
    if nbytes >= HUGE_PAGE and _thp_enabled():
        assert t.data_ptr() % HUGE_PAGE == 0
        assert _anon_huge_kib(t.data_ptr()) >= HUGE_PAGE // 1024


def test_packed_panels_share_one_huge_page_buffer():
    """All fp32 panels of a model sit in one buffer (on 2 MiB pages where THP allows): small weights too, which
    alone would come from the heap's 4 KiB pages."""
    layers = nn.ModuleList([ColumnParallelLinear(512, 1024, bias=False) for _ in range(3)])
    for p in layers.parameters():
        p.data = torch.randn(p.shape)
    want = [F.linear(torch.ones(2, 512), m.weight) for m in layers]
    assert pack_linears(layers, panels=True) == 3
    ptrs = sorted(m.panel_weight.panels.data_ptr() for m in layers)
    assert [ptrs[1] - ptrs[0], ptrs[2] - ptrs[1]] == [512 * 1024 * 4] * 2  # consecutive slices of one buffer
    for m, w in zip(layers, want):
        torch.testing.assert_close(cpu_backend().linear(m, torch.ones(2, 512), None), w, atol=1e-3, rtol=1e-5)
    if _thp_enabled():
        assert ptrs[0] % HUGE_PAGE == 0 and _anon_huge_kib(ptrs[0]) >= HUGE_PAGE // 1024


@pytest.mark.parametrize("v", [1, 7, 8, 40, 32000])  # 40: 16-lane steps and a tail
def test_argmax_matches_torch(v):
    x = torch.randn(9, v + 3)[:, 1:1 + v]  # strided rows
    x[1] = 0.5  # all tied: the first
    x[2, v // 2:] = float("inf")
    x[3] = float("-inf")
    x[4, v // 3] = float("nan")
    x[5, -1] = float("nan")
    x[6, 0] = x[6, -1] = 1e30  # tied maxima at both ends
    assert torch.equal(cpu_fused.argmax(x), x.argmax(dim=1))
    assert cpu_fused.argmax(torch.empty(0, v)).shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_matches_f_embedding(dtype):
    w = torch.randn(1000, 72).to(dtype)
    ids = torch.randint(0, 1000, (3, 130))
    assert cpu_fused.gather_rows_supported(w, ids)
    assert torch.equal(cpu_fused.gather_rows(w, ids), F.embedding(ids, w))
    with pytest.raises(IndexError, match="out of range"):
        cpu_fused.gather_rows(w, torch.tensor([5, 1000]))


@pytest.mark.skipif(not cpu_extension.available(), reason="the C++ extension does not build here")
def test_the_read_rate_probe_reads_every_byte():
    """stream_read returns the xor of the buffer's 32-bit words: a byte changed anywhere (each thread's share, the
    prefetched tail) changes it."""
    buf = torch.randint(0, 256, (3 * 4096 * 256 + 256,), dtype=torch.uint8)
    words = buf.view(torch.int32)
    expected = 0
    for w in words.tolist():
        expected ^= w & 0xFFFFFFFF
    probe = cpu_extension.load().stream_read
    assert probe(buf) == expected
    for i in (0, 4096 * 256 + 7, buf.numel() - 1):
        buf[i] ^= 0x10
        assert probe(buf) != expected
        buf[i] ^= 0x10
    with pytest.raises(RuntimeError, match="256-byte"):
        probe(buf[:100])
