"""The bundled demo model: the default model, loadable by transformers, same greedy text as HF."""
from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedserve import LLM, SamplingParams
from pagedserve.common.config import default_model_dir


def test_bundled_model_is_default_and_matches_hf():
    model_dir = default_model_dir()
    assert os.path.getsize(os.path.join(model_dir, "model.safetensors")) <= 20 * 2**20
    llm = LLM()  # no model: the bundled one
    assert llm.llm_engine.config.model_config.model == model_dir
    prompts = ["def __init__(self", "import os\n\ndef", "for i in range("]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        ref = hf.generate(ids, max_new_tokens=24, do_sample=False,
                          attention_mask=torch.ones_like(ids))[0, ids.shape[1]:]
        ref = ref.tolist()
        if tok.eos_token_id in ref:
            ref = ref[: ref.index(tok.eos_token_id) + 1]
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)
