"""Triton kernels against the torch reference ops (compiled on CUDA, interpreted on CPU)."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import torch_ref
from pagedserve.kernels.triton import attention as triton_attention
from pagedserve.kernels.triton import ops as triton_ops
from pagedserve.kernels.triton.attention import AttentionConfig

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator, extra_cols: int = 2
) -> torch.Tensor:
    """Each sequence gets distinct physical blocks in shuffled order; unused entries hold other
    in-range block ids, so reading past a sequence's blocks gives wrong numbers, not a crash."""
    need = [-(-s // block_size) for s in seq_lens]
    assert sum(need) <= num_blocks
    width = max(need, default=0) + extra_cols
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used : used + n]
        used += n
    return table


def _attention_case(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_kv_heads: int = 2,
    gqa: int = 1,
    block_size: int = 16,
    head_size: int = 64,
    dtype: torch.dtype = F32,
    index_dtype: torch.dtype = torch.int32,
    spare_blocks: int = 3,
    seed: int = 0,
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + spare_blocks
    num_tokens = sum(q_lens)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    return dict(
        query=torch.randn(num_tokens, num_kv_heads * gqa, head_size, generator=gen).to(DEVICE, dtype),
        k_cache=torch.randn(shape, generator=gen).to(DEVICE, dtype),
        v_cache=torch.randn(shape, generator=gen).to(DEVICE, dtype),
        block_tables=_block_tables(seq_lens, block_size, num_blocks, gen).to(DEVICE, index_dtype),
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]).to(DEVICE, index_dtype),
        seq_lens=torch.tensor(seq_lens).to(DEVICE, index_dtype),
        scale=head_size**-0.5,
    )


def _run_and_compare(case: dict, config: AttentionConfig | None = None) -> torch.Tensor:
    expected = torch_ref.paged_attention(**case)
    if config is None:
        got = triton_ops.paged_attention(**case)
    else:
        got = triton_attention.paged_attention(**case, out=torch.empty_like(case["query"]), config=config)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, **TOL[case["query"].dtype])
    return got


def _mixed_lens(bs: int) -> tuple[list[int], list[int]]:
    """Decodes ending just before, on and just after block boundaries, a chunk whose cached
    prefix ends on a boundary, a chunk that starts mid-block, a whole prompt and an idle slot."""
    q_lens = [1, 1, 1, 1, 9, 5, bs + 3, 0]
    seq_lens = [bs - 1, bs, bs + 1, 2 * bs + 1, 2 * bs + 9, bs + 7, bs + 3, 5]
    return q_lens, seq_lens


# Every GQA ratio x block size x head size in fp32; a spread of them in fp16 and bf16.
MIXED_CASES = [
    (gqa, bs, hs, F32) for gqa in (1, 2, 4) for bs in (16, 32) for hs in (64, 80, 96, 128)
] + [
    (4, 32, 128, F16),
    (2, 16, 80, F16),
    (1, 32, 64, F16),
    (1, 32, 96, BF16),
    (4, 16, 64, BF16),
    (2, 32, 128, BF16),
]


@pytest.mark.parametrize("gqa,block_size,head_size,dtype", MIXED_CASES)
def test_attention_mixed_batch(gqa: int, block_size: int, head_size: int, dtype: torch.dtype) -> None:
    q_lens, seq_lens = _mixed_lens(block_size)
    case = _attention_case(
        q_lens, seq_lens, gqa=gqa, block_size=block_size, head_size=head_size, dtype=dtype
    )
    _run_and_compare(case)  # the heuristic's tiles: few, large
    # Small tiles: several query blocks per sequence, several online-softmax steps, and key
    # tiles that cover half a cache block (block size 32) or two cache blocks (block size 16).
    _run_and_compare(case, AttentionConfig(block_q=8, tile_n=16 if block_size == 32 else 32))


def test_attention_decode_only() -> None:
    bs = 16
    seq_lens = [bs - 1, bs, bs + 1, 3 * bs, 1, 2 * bs - 1]
    case = _attention_case([1] * len(seq_lens), seq_lens, gqa=4, head_size=128, block_size=bs)
    _run_and_compare(case)


def test_attention_prefill_only() -> None:
    bs = 32
    seq_lens = [bs - 1, bs + 1, 2 * bs]
    case = _attention_case(seq_lens, seq_lens, gqa=2, head_size=80, block_size=bs)
    _run_and_compare(case)


@pytest.mark.parametrize(
    "block_size,config",
    [
        # several query blocks per sequence; key tiles smaller than a cache block
        (32, AttentionConfig(block_q=4, tile_n=16)),
        # key tiles spanning several cache blocks
        (16, AttentionConfig(block_q=8, tile_n=64)),
    ],
    ids=["tile_lt_block", "tile_gt_block"],
)
def test_attention_chunked_prefill_tilings(block_size: int, config: AttentionConfig) -> None:
    q_lens = [13, 1, 2 * block_size]
    seq_lens = [2 * block_size + 13, block_size + 1, 3 * block_size]
    case = _attention_case(q_lens, seq_lens, gqa=2, head_size=96, block_size=block_size)
    _run_and_compare(case, config)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_attention_split_kv_forced(dtype: torch.dtype) -> None:
    # Partitions of 32 keys: the last split of the shorter sequences is empty, and the prefill
    # rows have splits where every key is masked; both must drop out of the reduction.
    q_lens = [1, 1, 6, 1]
    seq_lens = [97, 32, 70, 15]
    config = AttentionConfig(block_q=4, tile_n=16, num_splits=4, partition_size=32)
    case = _attention_case(q_lens, seq_lens, gqa=4, head_size=80, block_size=16, dtype=dtype)
    _run_and_compare(case, config)


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _fp8_case(case: dict, cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> dict:
    """``case`` with its caches quantized as ``reshape_and_cache`` stores them (keys 3x the scale's unit)."""
    k = torch_ref.quantize_fp8(3 * k_scale * case["k_cache"].float(), k_scale, cache_dtype)
    v = torch_ref.quantize_fp8(v_scale * case["v_cache"].float(), v_scale, cache_dtype)
    return {**case, "k_cache": k, "v_cache": v, "k_scale": k_scale, "v_scale": v_scale}


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_attention_over_fp8_cache(cache_dtype: torch.dtype, dtype: torch.dtype) -> None:
    q_lens, seq_lens = _mixed_lens(16)
    case = _fp8_case(_attention_case(q_lens, seq_lens, gqa=2, dtype=dtype), cache_dtype, 0.5, 2.0)
    _run_and_compare(case)
    _run_and_compare(case, AttentionConfig(block_q=4, tile_n=16, num_splits=4, partition_size=32))  # v_scale x splits


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
def test_reshape_and_cache_fp8_writes_the_reference_bytes(cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    kv = (torch.finfo(cache_dtype).max / 10 * torch.randn(23, 7, 64, generator=gen)).to(DEVICE, BF16)
    key, value = kv[:, :3], kv[:, 4:]
    slots = torch.randperm(6 * 16, generator=gen)[:23].to(DEVICE)
    slots[[0, 9]] = -1
    caches = [torch.zeros(6, 16, 3, 64, dtype=cache_dtype, device=DEVICE) for _ in range(4)]
    triton_ops.reshape_and_cache(key, value, caches[0], caches[1], slots, 0.25, 3.0)
    torch_ref.reshape_and_cache(key, value, caches[2], caches[3], slots, 0.25, 3.0)
    assert caches[0].float().abs().max() == torch.finfo(cache_dtype).max  # saturated, not inf or NaN
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    moved = [c.clone() for c in caches[:2]]
    mapping = torch.tensor([[0, 5], [3, 1]], device=DEVICE)
    triton_ops.copy_blocks(moved[:1], moved[1:], mapping)
    torch_ref.copy_blocks(caches[:1], caches[1:2], mapping)
    assert torch.equal(moved[0].view(torch.uint8), caches[0].view(torch.uint8))
    host = torch.zeros(4, 16, 3, 64, dtype=cache_dtype)
    triton_ops.swap_blocks(caches[0], host, torch.tensor([[1, 0], [4, 3]]))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(host[3].view(torch.uint8), caches[0][4].cpu().view(torch.uint8))


def test_attention_split_kv_heuristic_path() -> None:
    # One long decode with one KV head: too few programs to fill the device, so split.
    case = _attention_case([1], [700], num_kv_heads=1, gqa=4, head_size=64, block_size=32)
    num_sms = 132 if DEVICE.type == "cuda" else 1
    cfg = triton_attention.choose_config(
        num_seqs=1, max_q_len=1, max_seq_len=700, num_kv_heads=1, gqa=4, head_size=64,
        num_sms=num_sms, on_gpu=DEVICE.type == "cuda",
    )
    assert cfg.num_splits > 1
    _run_and_compare(case)


def test_split_heuristic_choices() -> None:
    def splits(num_seqs: int, max_q_len: int, max_seq_len: int) -> AttentionConfig:
        return triton_attention.choose_config(
            num_seqs=num_seqs, max_q_len=max_q_len, max_seq_len=max_seq_len,
            num_kv_heads=8, gqa=4, head_size=128, num_sms=132,
        )

    long_decode = splits(1, 1, 8192)
    assert long_decode.num_splits > 1
    assert long_decode.partition_size % long_decode.tile_n == 0
    assert long_decode.num_splits * long_decode.partition_size >= 8192
    assert (long_decode.num_splits - 1) * long_decode.partition_size < 8192
    assert splits(256, 1, 8192).num_splits == 1  # enough programs already
    assert splits(1, 1, 128).num_splits == 1  # context too short
    assert splits(1, 2048, 8192).num_splits == 1  # prefill
    big_prefill = splits(1, 2048, 2048)
    assert big_prefill.block_q * 4 <= 128 and big_prefill.num_splits == 1


def test_attention_int64_out_and_strided_query() -> None:
    q_lens, seq_lens = [3, 1, 0, 1], [19, 33, 4, 16]
    case = _attention_case(q_lens, seq_lens, gqa=2, index_dtype=torch.int64)
    num_tokens, num_heads, head_size = case["query"].shape
    # query and out as views into wider buffers (as a fused QKV projection would give)
    qkv = torch.randn(num_tokens, num_heads + 4, head_size, device=DEVICE)
    qkv[:, :num_heads] = case["query"]
    expected = torch_ref.paged_attention(**case)
    case["query"] = qkv[:, :num_heads]
    buf = torch.full((num_tokens + 2, num_heads + 1, head_size), 7.0, device=DEVICE)
    out = buf[:num_tokens, 1:]
    got = triton_ops.paged_attention(**case, out=out)
    assert got is out
    torch.testing.assert_close(out, expected, **TOL[F32])
    assert bool((buf[:, 0] == 7.0).all()) and bool((buf[num_tokens:] == 7.0).all())


def test_attention_leaves_padding_rows_alone() -> None:
    # Two trailing rows belong to no sequence (e.g. padding to a captured batch size).
    case = _attention_case([2, 1, 0], [18, 17, 0], gqa=2)
    case["query"] = torch.cat([case["query"], torch.randn_like(case["query"][:2])])
    out = torch.full_like(case["query"], 3.0)
    expected = torch_ref.paged_attention(**case, out=out.clone())
    got = triton_ops.paged_attention(**case, out=out)
    torch.testing.assert_close(got, expected, **TOL[F32])
    assert bool((got[3:] == 3.0).all())


def test_attention_rejects_bad_shapes() -> None:
    case = _attention_case([1], [5], num_kv_heads=2, gqa=1)
    case["query"] = case["query"][:, :1].repeat(1, 3, 1)  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match="multiple"):
        triton_ops.paged_attention(**case)


@pytest.mark.parametrize(
    "key_dtype,cache_dtype,block_size,head_size,index_dtype",
    [
        (F32, F32, 16, 80, torch.int32),
        (F16, F16, 32, 128, torch.int64),
        (BF16, BF16, 16, 96, torch.int32),
        (F32, F16, 32, 64, torch.int64),
    ],
)
def test_reshape_and_cache(
    key_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    block_size: int,
    head_size: int,
    index_dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_kv_heads, num_tokens = 6, 3, 23
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 7, 22]] = -1  # padding tokens
    kv = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_size, generator=gen).to(DEVICE, key_dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads + 1 :]  # strided views
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache = torch.randn(shape, generator=gen).to(DEVICE, cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(DEVICE, cache_dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    slot_mapping = slots.to(DEVICE, index_dtype)
    torch_ref.reshape_and_cache(key, value, k_expected, v_expected, slot_mapping)
    triton_ops.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    assert not torch.equal(k_expected, k_cache.new_zeros(shape))
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


def _layer_caches(num_layers: int, dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(8, 16, 2, 80, generator=gen).to(DEVICE, dtype) for _ in range(num_layers)]


@pytest.mark.parametrize("dtype", [F16, F32])
def test_copy_blocks(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    k_caches, v_caches = _layer_caches(3, dtype, gen), _layer_caches(3, dtype, gen)
    k_expected = [c.clone() for c in k_caches]
    v_expected = [c.clone() for c in v_caches]
    mapping = torch.tensor([[0, 5], [3, 1], [0, 6], [7, 2]], dtype=torch.int32)
    torch_ref.copy_blocks(k_expected, v_expected, mapping)
    triton_ops.copy_blocks(k_caches, v_caches, mapping.to(DEVICE))
    for got, want in zip(k_caches + v_caches, k_expected + v_expected):
        assert torch.equal(got, want)
    triton_ops.copy_blocks(k_caches, v_caches, torch.empty(0, 2, dtype=torch.int64))


def test_copy_blocks_mixed_layouts_fall_back() -> None:
    gen = torch.Generator().manual_seed(3)
    k_caches = [*_layer_caches(1, F16, gen), *_layer_caches(1, F32, gen)]
    v_caches = [*_layer_caches(1, F16, gen), *_layer_caches(1, F32, gen)]
    expected = [c.clone() for c in k_caches + v_caches]
    mapping = torch.tensor([[4, 0], [2, 3]])
    torch_ref.copy_blocks(expected[:2], expected[2:], mapping)
    triton_ops.copy_blocks(k_caches, v_caches, mapping)
    for got, want in zip(k_caches + v_caches, expected):
        assert torch.equal(got, want)


def _swap_check(src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor) -> None:
    expected = dst.clone()
    torch_ref.swap_blocks(src, expected, mapping)
    triton_ops.swap_blocks(src, dst, mapping)
    if dst.is_cuda or src.is_cuda:
        torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), expected.cpu())


# Runs of consecutive blocks on both sides, on one side only, and single blocks.
SWAP_MAPPING = torch.tensor([[0, 4], [1, 5], [6, 0], [3, 2], [2, 3]])


def test_swap_blocks_same_device() -> None:
    gen = torch.Generator().manual_seed(4)
    src = torch.randn(8, 16, 2, 64, generator=gen).to(DEVICE)
    dst = torch.zeros(7, 16, 2, 64, device=DEVICE)
    _swap_check(src, dst, SWAP_MAPPING)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pinned", [True, False])
def test_swap_blocks_across_devices(pinned: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    gpu = torch.randn(8, 16, 2, 64, generator=gen).to("cuda", F16)
    host = torch.randn(7, 16, 2, 64, generator=gen).to(F16)
    if pinned:
        host = host.pin_memory()
    _swap_check(gpu, host, SWAP_MAPPING)  # swap out
    gpu_back = torch.zeros(8, 16, 2, 64, dtype=F16, device="cuda")
    back = torch.tensor([[4, 7], [5, 2], [0, 0]])
    _swap_check(host, gpu_back, back)  # swap in
