"""Weight-only int8 (``quantization="int8"``) end to end on the bundled demo model: greedy tokens equal the
dequantized model's (a checkpoint holding ``q * scale``, run unquantized), perplexity on held-out text within 2% of
bf16, linears really int8 (and their full-precision weights gone), the features that must keep working (prefix
caching, n-gram speculative decoding, structured output), and the refusals."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sysconfig

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM, SamplingParams
from pagedserve.common.config import default_model_dir
from pagedserve.common.sampling_params import StructuredOutputsParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.kernels import torch_ref
from pagedserve.kernels.cpu import gemm_int8 as cpu_gemm_int8

PROMPTS = ["def __init__(self", "import os\n\ndef", "for i in range(", "class Parser:\n    def parse(self, text):",
           "    return self._"]
GREEDY = SamplingParams(temperature=0, max_tokens=32)
KV_BYTES = 64 << 20  # on CUDA, not 90% of the GPU for a few short prompts
LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
# Held out of the demo model's training (assets/train_demo_model.py skips idlelib/ and test/ directories).
HELD_OUT = ["idlelib/editor.py", "test/test_grammar.py"]


def _greedy(llm: LLM, prompts: list[str], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _model(llm: LLM):
    return llm.llm_engine.core.executor.worker.model_runner.model


@pytest.fixture(scope="module")
def dequantized_dir(tmp_path_factory) -> str:
    """The demo model with every linear weight, the LM head's included, replaced by its int8 dequantization
    ``q * scale`` (fp32); its tied LM head untied, as the embedding keeps its full-precision rows."""
    path = tmp_path_factory.mktemp("dequantized")
    src = default_model_dir()
    for name in os.listdir(src):
        if name not in ("model.safetensors", "config.json"):
            shutil.copy(os.path.join(src, name), path)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    if config.get("tie_word_embeddings", True):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        config["tie_word_embeddings"] = False
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    for name, w in tensors.items():
        if LINEAR.search(name) or name == "lm_head.weight":
            q, scale = torch_ref.quantize_int8(w)
            tensors[name] = q.float() * scale[:, None]
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def int8_llm():
    llm = LLM(quantization="int8")
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_greedy_equals_dequantized_model(dequantized_dir, device):
    """In fp32, where the int8 GEMM's ``(x @ q) * scale`` (on CUDA: the torch reference) and the dequantized
    ``x @ (q * scale)`` differ only by fp32 rounding."""
    int8 = LLM(quantization="int8", dtype="float32", device=device, kv_cache_memory=KV_BYTES)
    try:
        assert int8.llm_engine.config.model_config.quantization == "int8"
        got = _greedy(int8, PROMPTS)
    finally:
        int8.shutdown()
    ref = LLM(dequantized_dir, dtype="float32", device=device, kv_cache_memory=KV_BYTES)
    try:
        want = _greedy(ref, PROMPTS)
    finally:
        ref.shutdown()
    assert got == want


def test_linears_are_int8_and_the_rest_is_not(int8_llm):
    model = _model(int8_llm)
    layer = model.model.layers[0]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    for m in linears:
        assert m.weight_scale.dtype == torch.float32
        if cpu_gemm_int8.available():  # packed: the int8 panels hold the weight, the plain one is freed
            assert isinstance(m.panel_weight, cpu_gemm_int8.Int8PanelWeight) and m.weight.numel() == 0
            assert m.panel_weight.panels.dtype == torch.int8
        else:
            assert m.weight.dtype == torch.int8
    head, embedding = model.lm_head, model.model.embed_tokens.weight
    assert head.weight_scale.dtype == torch.float32  # the tied LM head has an int8 weight of its own
    if cpu_gemm_int8.available():
        assert isinstance(head.panel_weight, cpu_gemm_int8.Int8PanelWeight) and head.weight.numel() == 0
    else:
        assert head.weight.dtype == torch.int8
    assert embedding.dtype in (torch.bfloat16, torch.float32) and embedding.numel() > 0
    if cpu_gemm_int8.available():  # the one-call C++ layers run the int8 panels
        assert len(model.model.cpu_layers.weights) == len(model.model.layers)
    quantized = sum(m.panel_weight.panels.numel() if hasattr(m, "panel_weight") else m.weight.numel()
                    for m in model.modules() if hasattr(m, "weight_scale"))
    full = sum(p.numel() for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.float32)
    assert quantized > full  # the linears are most of the model, and no full-precision copy of them is left


def _held_out_text() -> str:
    stdlib = sysconfig.get_paths()["stdlib"]
    for rel in HELD_OUT:
        path = os.path.join(stdlib, rel)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
    pytest.skip(f"none of {HELD_OUT} in this Python's stdlib")


def perplexity(llm: LLM, text: str, chunk: int = 512, chunks: int = 4) -> float:
    """exp of the mean negative log-likelihood of the text's tokens, from prompt_logprobs over ``chunks`` chunks."""
    ids = llm.get_tokenizer().encode(text)[: chunk * chunks]
    prompts = [{"prompt_token_ids": ids[i:i + chunk]} for i in range(0, len(ids), chunk)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    nll = [-lp[t].logprob for p, o in zip(prompts, outs)
           for t, lp in zip(p["prompt_token_ids"][1:], o.prompt_logprobs[1:])]
    return math.exp(sum(nll) / len(nll))


def test_perplexity_within_two_percent_of_bf16(int8_llm):
    text = _held_out_text()
    bf16 = LLM(dtype="bfloat16")
    try:
        base = perplexity(bf16, text)
    finally:
        bf16.shutdown()
    int8 = perplexity(int8_llm, text)
    print(f"held-out perplexity: bf16 {base:.4f}, int8 {int8:.4f} ({100 * (int8 / base - 1):+.2f}%)")
    assert abs(int8 / base - 1) < 0.02


def test_prefix_caching_speculative_decoding_and_structured_output(int8_llm):
    """Each feature with int8 gives the greedy tokens int8 gives without it (structured output: the constraint
    holds, and where the unconstrained greedy text already satisfies it, the same text)."""
    shared = "import os\nimport sys\n\n\ndef main(argv):\n    "
    prompts = [shared + "return", shared + "for", shared + "if"]
    plain = LLM(quantization="int8", enable_prefix_caching=False)
    try:
        want = _greedy(plain, prompts + PROMPTS)
    finally:
        plain.shutdown()
    assert _greedy(int8_llm, prompts) + _greedy(int8_llm, PROMPTS) == want  # the second and third hit the cache
    spec = LLM(quantization="int8", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    try:
        assert _greedy(spec, prompts + PROMPTS) == want
    finally:
        spec.shutdown()
    regex = r"[a-z_]+\([a-z_, ]*\)"
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=regex))
    out = int8_llm.generate(["result = "], params, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(regex, out.text), out.text
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    out = int8_llm.generate(["config = "], params, use_tqdm=False)[0].outputs[0]
    assert isinstance(json.loads(out.text)["name"], str), out.text


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="int4").create_engine_config()
    quantized = tmp_path / "quantized"
    shutil.copytree(default_model_dir(), quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="already quantized .*awq"):
        EngineArgs(str(quantized), quantization="int8").create_engine_config()
    EngineArgs(str(quantized)).create_engine_config()  # unset: as before
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--quantization", "int8"])).quantization == "int8"
    assert EngineArgs.from_cli_args(parser.parse_args([])).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "fp4"])
