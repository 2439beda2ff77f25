"""The one-call C++ decoder layer (kernels/cpu/layer.py) gives bitwise the module path's hidden states and KV cache,
on a mixed step (prefill chunks beside decodes), with GQA and every bias a LLaMA-family layer can have, in fp32
(panel GEMM) and in bf16 (AVX512-BF16 panel GEMM, where this CPU has it); also with int8 weights and over fp8
caches."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.kernels.cpu import gemm_bf16 as cpu_gemm_bf16
from pagedserve.tests.utils import backend_context, cpu_backend
from pagedserve.worker.cpu.decoder_layer import attach_decoder_layers
from pagedserve.worker.cpu.packing import pack_linears
from pagedserve.worker.forward_context import AttentionMetadata
from pagedserve.worker.layers.quantization import quantize_linears
from pagedserve.worker.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(not cpu_extension.available(), reason="no C++ compiler")
BLOCK = 16


def _config(**kw):
    # Imported here: at collection, `transformers.LlamaConfig` imports triton, before test_kernels_triton.py can
    # switch triton to its CPU interpreter.
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=256, **kw)


def _model(bias: bool, dtype: torch.dtype = torch.float32, int8: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(num_hidden_layers=3, attention_bias=bias, mlp_bias=bias))
    for p in model.parameters():  # parameters only: rotary tables stay fp32, as the loader leaves them
        p.data = (torch.randn(p.shape) * 0.3).to(dtype)
    if int8:
        quantize_linears(model, "int8")
    pack_linears(model, panels=True, bf16_panels=True)
    attach_decoder_layers(model)
    return model


def _bind_caches(model: LlamaForCausalLM, num_blocks: int,
                 cache_dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    caches = []
    for layer in model.model.layers:
        a = layer.self_attn.attn
        dtype = cache_dtype or layer.input_layernorm.weight.dtype
        if dtype == torch.float8_e4m3fn:
            a.k_scale, a.v_scale = 0.5, 2.0
        a.k_cache = torch.zeros(num_blocks, BLOCK, a.num_kv_heads, a.head_size, dtype=dtype)
        a.v_cache = torch.zeros_like(a.k_cache)
        caches.append((a.k_cache, a.v_cache))
    return caches


def _step(model, tokens: list[list[int]], starts: list[int]) -> torch.Tensor:
    """One forward pass: sequence i (blocks 4i .. 4i+3) runs tokens[i] from position starts[i]."""
    ids, pos, slots, qsl, lens = [], [], [], [0], []
    for i, (toks, s) in enumerate(zip(tokens, starts)):
        ids += toks
        pos += range(s, s + len(toks))
        slots += [(4 * i + p // BLOCK) * BLOCK + p % BLOCK for p in range(s, s + len(toks))]
        qsl.append(len(ids))
        lens.append(s + len(toks))
    md = AttentionMetadata(torch.tensor(slots), torch.arange(4 * len(tokens), dtype=torch.int32).view(-1, 4),
                           torch.tensor(qsl, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32))
    with torch.inference_mode(), backend_context(cpu_backend(), md):
        return model(torch.tensor(ids), torch.tensor(pos))


DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not cpu_gemm_bf16.available(), reason="no AVX512-BF16 on this CPU"))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias,int8,cache_dtype", [(False, False, None), (True, False, None), (True, True, None),
                                                   (False, False, torch.float8_e4m3fn),
                                                   (True, True, torch.float8_e4m3fn)])
def test_one_call_layers_equal_the_module_path_bitwise(bias, int8, cache_dtype, dtype):
    model = _model(bias, dtype, int8)
    one_call = model.model.cpu_layers
    assert len(one_call.weights) == 3
    assert all(w.dtype == (torch.int8 if int8 else dtype) for w in one_call.weights[0].weights)
    prefill = [[5, 6, 7, 8, 9], list(range(10, 30)), [1, 2, 3]]
    step2 = [[41], [42], [43, 44, 45, 46]]  # two decodes beside a prefill chunk
    runs = []
    for fused in (True, False):
        model.model.cpu_layers = one_call if fused else None
        caches = _bind_caches(model, 12, cache_dtype)
        hidden = [_step(model, prefill, [0, 0, 0]), _step(model, step2, [5, 20, 3])]
        runs.append((hidden, [c.clone() for kv in caches for c in kv]))
    (h_fused, kv_fused), (h_mod, kv_mod) = runs
    for a, b in zip(h_fused + kv_fused, h_mod + kv_mod):
        assert torch.equal(a.view(torch.uint8) if cache_dtype and a.dtype == cache_dtype else a,
                           b.view(torch.uint8) if cache_dtype and b.dtype == cache_dtype else b)
    assert h_fused[1].shape == (6, 64) and h_fused[1].dtype == dtype and h_fused[1].abs().sum() > 0


def test_one_call_layers_need_panels():
    model = LlamaForCausalLM(_config(num_hidden_layers=1))
    pack_linears(model, panels=False, bf16_panels=False)  # oneDNN's layout: the module path
    assert not attach_decoder_layers(model) and model.model.cpu_layers is None
