"""Bad input raises a clear ValueError before anything is allocated; other requests are unaffected."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.tests.utils import VOCAB, assert_all_blocks_free


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=128)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"),
    (dict(n=2, best_of=1), "best_of"),
    (dict(stop=[""]), "stop"),
    (dict(stream_interval=0), "stream_interval"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, params, match", [
    ("", SamplingParams(), "empty"),
    ({"prompt_token_ids": []}, SamplingParams(), "empty"),
    ({"prompt_token_ids": [1, VOCAB, 3]}, SamplingParams(), "outside the vocabulary"),
    ({"prompt_token_ids": [1, -4]}, SamplingParams(), "outside the vocabulary"),
    ({"prompt_token_ids": list(range(3, 103))}, SamplingParams(max_tokens=29), "max_model_len"),
    ({"prompt_token_ids": [5] * 200}, SamplingParams(), "max_model_len"),
    ({"prompt_token_ids": [5, 6]}, SamplingParams(stop_token_ids=[VOCAB + 5]), "stop_token_ids"),
    ({"nothing": 1}, SamplingParams(), "prompt"),
])
def test_bad_requests_leave_engine_healthy(llm, prompt, params, match):
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match=match):
        llm.generate([good, prompt], params, use_tqdm=False)
    assert_all_blocks_free(llm)  # the good prompt was not queued either
    out = llm.generate([good], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1
    assert_all_blocks_free(llm)


def test_bad_model_dirs(tmp_path, llama_dir, model_factory):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing"))
    no_weights = tmp_path / "no_weights"
    shutil.copytree(llama_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(no_weights))
    weird = tmp_path / "weird"
    shutil.copytree(llama_dir, weird)
    cfg = json.loads((weird / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (weird / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="supported: .*LlamaForCausalLM"):
        LLM(str(weird))


def test_bad_engine_args(llama_dir):
    with pytest.raises(ValueError, match="unknown LLM arguments"):
        LLM(llama_dir, max_num_seqz=3)
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(llama_dir, attention_backend="cuda-magic")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(llama_dir, max_model_len=10_000)
    with pytest.raises(ValueError, match="block_size"):
        LLM(llama_dir, block_size=12)
    with pytest.raises(ValueError, match="stream_interval"):
        LLM(llama_dir, stream_interval=0)


def test_request_too_big_for_the_kv_pool(llama_dir):
    llm = LLM(llama_dir, num_gpu_blocks_override=2)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate({"prompt_token_ids": [5] * 40}, SamplingParams(max_tokens=10), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_sharded_checkpoint_loads(tmp_path, llama_dir):
    """A model split over several safetensors files with an index loads like a single file."""
    from safetensors.torch import load_file, save_file

    sharded = tmp_path / "sharded"
    shutil.copytree(llama_dir, sharded, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(os.path.join(llama_dir, "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(sharded / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    prompt = {"prompt_token_ids": [5, 17, 99, 42]}
    params = SamplingParams(temperature=0, max_tokens=8)
    a = LLM(llama_dir).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    b = LLM(str(sharded)).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
