"""Fast kernels on every shape a valid config and TP size can give: each dispatch, on sizes off the vector widths
(hidden, intermediate, head and vocab sizes not multiples of 8 or 16, GQA ratios, head sizes 64/80/96/128, one-token
and long rows), never raises and matches the torch reference; tiny LLaMA models with such sizes generate HF's greedy
tokens (TP 2 and 3 on Ray: tests/cluster/test_odd_shapes_tp.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve import LLM
from pagedserve.kernels import torch_ref
from pagedserve.kernels.backend import KernelBackend
from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.kernels.cpu import fused as cpu_fused
from pagedserve.kernels.cpu import gemm as cpu_gemm
from pagedserve.kernels.cpu import gemm_bf16 as cpu_gemm_bf16
from pagedserve.kernels.cpu import layer as cpu_layer
from pagedserve.kernels.triton import ops as triton_ops
from pagedserve.tests.utils import assert_greedy_equals_hf, backend_context, cpu_backend, random_prompts
from pagedserve.worker.cpu.decoder_layer import attach_decoder_layers
from pagedserve.worker.cpu.packing import pack_linears
from pagedserve.worker.forward_context import AttentionMetadata
from pagedserve.worker.layers.activation import SiluAndMul
from pagedserve.worker.layers.layernorm import RMSNorm
from pagedserve.worker.layers.rotary import RotaryEmbedding

BUILT = cpu_extension.available()
pytestmark = pytest.mark.usefixtures("cpu_kernels")  # layers run alone, on the C++ kernels
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
ROWS = [1, 37]  # one token; a prefill of many rows
SIZES = [1, 7, 12, 50, 72, 80, 100, 150, 333]  # rows of any width: a scalar tail past the 16- and 8-lane steps
HEADS = [(6, 2, 12), (6, 3, 80), (4, 4, 64), (6, 2, 96), (4, 1, 128), (6, 6, 36)]  # (Hq, Hkv, head size)


def _cpu() -> KernelBackend:
    """The C++ backend, or the spec's where the extension is not built."""
    return cpu_backend() if BUILT else KernelBackend(torch.device("cpu"))


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", SIZES)
def test_rms_norm_any_hidden_size(dtype, hidden):
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data = (1 + 0.1 * _randn(hidden, dtype=torch.float32, seed=1)).to(dtype)
    for rows in ROWS:
        x, res = _randn(rows, hidden, dtype=dtype), _randn(rows, hidden, dtype=dtype, seed=2)
        assert cpu_fused.rms_norm_supported(x, norm.weight, res) == BUILT  # the C++ path, not a fallback
        torch.testing.assert_close(norm(x).float(), torch_ref.rms_norm(x, norm.weight, 1e-6).float(), **TOL[dtype])
        total = (x.float() + res.float()).to(dtype)
        got, got_res = norm(x.clone(), res.clone())
        torch.testing.assert_close(got_res.float(), total.float(), **TOL[dtype])
        torch.testing.assert_close(got.float(), torch_ref.rms_norm(total, norm.weight, 1e-6).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", SIZES)
def test_silu_and_mul_any_intermediate_size(dtype, inter):
    for rows in ROWS:
        x = 3 * _randn(rows, 2 * inter, dtype=torch.float32).to(dtype)
        assert cpu_fused.silu_and_mul_supported(x) == BUILT
        want = F.silu(x.float()[:, :inter]) * x.float()[:, inter:]
        torch.testing.assert_close(SiluAndMul()(x).float(), want, **TOL[dtype])
    odd = _randn(3, 2 * inter + 1, dtype=dtype)  # not a gate/up pair: no kernel
    assert not cpu_fused.silu_and_mul_supported(odd)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv, head", HEADS)
@pytest.mark.parametrize("partial", [1.0, 0.25])
def test_rotary_any_head_size(dtype, hq, hkv, head, partial):
    rot = int(head * partial) // 2 * 2
    rope = RotaryEmbedding(head, rot, 512, 10000.0)
    for rows in ROWS:
        qkv = _randn(rows, (hq + 2 * hkv) * head, dtype=dtype)  # q and k as strided views, as the layer has them
        q, k = qkv[:, :hq * head].view(rows, hq, head), qkv[:, hq * head:(hq + hkv) * head].view(rows, hkv, head)
        positions = torch.randint(0, 512, (rows,), generator=torch.Generator().manual_seed(3))
        want_q, want_k = torch_ref.rotary(positions, q.float(), k.float(), rope.cos, rope.sin, rot)
        assert cpu_fused.rotary_supported(positions, q, k, rope.cos, rope.sin, rot) == BUILT
        got_q, got_k = rope(positions, q, k)
        torch.testing.assert_close(got_q.float(), want_q, **TOL[dtype])
        torch.testing.assert_close(got_k.float(), want_k, **TOL[dtype])


def _paged_case(hq: int, hkv: int, head: int, dtype: torch.dtype, q_lens: list[int], ctx: list[int],
                block: int = 16) -> dict:
    g = torch.Generator().manual_seed(4)
    seq_lens = [q + c for q, c in zip(q_lens, ctx)]
    per_seq = max(-(-s // block) for s in seq_lens)
    blocks = per_seq * len(seq_lens)
    return dict(query=torch.randn(sum(q_lens), hq, head, generator=g).to(dtype),
                k_cache=torch.randn(blocks, block, hkv, head, generator=g).to(dtype),
                v_cache=torch.randn(blocks, block, hkv, head, generator=g).to(dtype),
                block_tables=torch.randperm(blocks, generator=g).view(len(seq_lens), per_seq).int(),
                query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), scale=head ** -0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv, head", HEADS)
def test_kv_writes_and_attention_any_head_size(dtype, hq, hkv, head):
    case = _paged_case(hq, hkv, head, dtype, q_lens=[1, 1, 23, 9], ctx=[0, 40, 0, 17])  # decodes, prefills
    kv = _randn(4, 2 * hkv + 1, head, dtype=dtype)
    key, value = kv[:, :hkv], kv[:, hkv + 1:]  # strided tokens
    slots = torch.tensor([3, -1, 17, 30])
    got_k, got_v = case["k_cache"].clone(), case["v_cache"].clone()
    _cpu().reshape_and_cache(key, value, got_k, got_v, slots)
    assert cpu_fused.reshape_and_cache_supported(key, value, got_k, got_v) == BUILT
    torch_ref.reshape_and_cache(key, value, case["k_cache"], case["v_cache"], slots)
    assert torch.equal(got_k, case["k_cache"]) and torch.equal(got_v, case["v_cache"])
    got = _cpu().paged_attention(**case)
    torch.testing.assert_close(got.float(), torch_ref.paged_attention(**case).float(), **TOL[dtype])


@pytest.mark.parametrize("vocab", [1, 7, 33, 331, 1000])
def test_bitmask_and_argmax_any_vocab_size(vocab):
    logits = _randn(5, vocab, dtype=torch.float32)
    assert torch.equal(_cpu().argmax(logits), logits.argmax(dim=1))
    rows = torch.tensor([0, 3])
    for words in (-(-vocab // 32), 1):  # every token's bit; too few words (the rest masked)
        bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (2, words), generator=torch.Generator().manual_seed(5),
                                dtype=torch.int32)
        assert cpu_fused.apply_token_bitmask_supported(logits, rows, bitmask) == BUILT
        assert torch.equal(_cpu().apply_token_bitmask(logits, rows, bitmask),
                           torch_ref.apply_token_bitmask(logits, rows, bitmask))


@pytest.mark.skipif(not BUILT, reason="no C++ compiler")
@pytest.mark.parametrize("m, k, n", [(1, 72, 331), (5, 100, 150), (37, 7, 13), (3, 80, 200)])
def test_panel_gemms_any_width(m, k, n):
    w, x = _randn(n, k, dtype=torch.float32), _randn(m, k, dtype=torch.float32, seed=1)
    torch.testing.assert_close(cpu_gemm.gemm(x, cpu_gemm.pack_weight(w)), x @ w.T, atol=1e-4, rtol=1e-4)
    wb, xb = w.bfloat16(), x.bfloat16()
    assert cpu_gemm_bf16.packable(wb) == (k % 2 == 0)  # odd K: oneDNN's layout instead
    if cpu_gemm_bf16.available() and cpu_gemm_bf16.packable(wb):
        torch.testing.assert_close(cpu_gemm_bf16.gemm(xb, cpu_gemm_bf16.pack_weight(wb)).float(),
                                   xb.float() @ wb.float().T, atol=5e-2, rtol=2e-2)


def test_triton_attention_any_head_size():
    """Head sizes the kernel pads (12, 80, GQA 3) run (interpreted on CPU); those tl.dot or its tiles cannot take
    (under 9, over 256) go to the torch reference instead of raising."""
    assert [triton_ops.attention_supported(torch.empty(1, 1, d), None) for d in (4, 8, 9, 12, 80, 256, 257)] == \
        [False, False, True, True, True, True, False]
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton takes CPU tensors only when interpreting
    for hq, hkv, head in [(6, 2, 12), (3, 1, 80), (2, 1, 4), (2, 2, 320)]:
        case = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                for k, v in _paged_case(hq, hkv, head, torch.float32, q_lens=[1, 5], ctx=[20, 3]).items()}
        torch.testing.assert_close(triton_ops.paged_attention(**case), torch_ref.paged_attention(**case),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not BUILT, reason="no C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not cpu_gemm_bf16.available(), reason="no AVX512-BF16 on this CPU"))])
def test_one_call_layer_odd_sizes_equal_the_module_path(dtype):
    from transformers import LlamaConfig

    from pagedserve.worker.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=331, hidden_size=72, intermediate_size=100, num_hidden_layers=2,
                                         num_attention_heads=6, num_key_value_heads=2, head_dim=80,
                                         max_position_embeddings=64))
    for p in model.parameters():
        p.data = (torch.randn(p.shape) * 0.3).to(dtype)
    pack_linears(model, panels=True, bf16_panels=True)
    assert attach_decoder_layers(model)  # hidden 72 and intermediate 100 no longer rule it out
    assert cpu_layer.takes(6, 2, 80, 80) and not cpu_layer.takes(6, 2, 12, 12)
    ids, positions = torch.arange(3, 12), torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2])  # two prefills
    md = AttentionMetadata(torch.tensor([0, 1, 2, 3, 4, 5, 16, 17, 18]), torch.tensor([[0], [1]], dtype=torch.int32),
                           torch.tensor([0, 6, 9], dtype=torch.int32), torch.tensor([6, 3], dtype=torch.int32))
    outs = []
    for layers in (model.model.cpu_layers, None):
        model.model.cpu_layers = layers
        for layer in model.model.layers:
            a = layer.self_attn.attn
            a.k_cache = torch.zeros(2, 16, a.num_kv_heads, a.head_size, dtype=dtype)
            a.v_cache = torch.zeros_like(a.k_cache)
        with torch.inference_mode(), backend_context(cpu_backend(), md):
            outs.append(model(ids, positions))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("arch", ["llama-odd-h72", "llama-odd-hd80", "llama-odd-hd96"])
def test_odd_models_greedy_match_hf(model_factory, arch):
    model_dir = model_factory(arch)
    prompts = random_prompts(3, seed=7, max_len=20)
    llm = LLM(model_dir, dtype="float32")  # "auto" is bf16 on CUDA
    try:
        assert_greedy_equals_hf(llm, model_dir, prompts, 8)
    finally:
        llm.shutdown()
