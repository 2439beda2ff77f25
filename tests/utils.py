"""Tiny random Hugging Face models (saved as safetensors dirs) and HF reference generation."""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import textwrap

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from pagedserve import SamplingParams
from pagedserve.engine.model_config import load_model_config
from pagedserve.kernels.backend import KernelBackend
from pagedserve.kernels.cpu.backend import CpuBackend
from pagedserve.worker import parallel_state
from pagedserve.worker.forward_context import ForwardContext, set_forward_context
from pagedserve.worker.models.loader import load_model


@functools.cache
def cpu_backend() -> CpuBackend:
    """The C++ backend, as a CPU worker of an fp32 or bf16 model has it (built on first use)."""
    return CpuBackend(torch.device("cpu"), torch.float32)


def backend_context(backend: KernelBackend | None = None, attn_metadata=None) -> contextlib.AbstractContextManager:
    """A forward context for layers run alone (default: the torch backend, the spec)."""
    return set_forward_context(ForwardContext(backend or KernelBackend(torch.device("cpu")), attn_metadata))


VOCAB = 331  # not divisible by 2 or 4, so vocab padding for TP is exercised
EOS = 2

_CORPUS = textwrap.dedent("""
    The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks.
    def main(argv):\n    return sum(int(x) for x in argv) if argv else None\n
    café naïve résumé — “quotes” and emoji 🚀🔥 and 中文字符 with ümlauts.
""")


def make_tokenizer(path: str, vocab_size: int = 300) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [_CORPUS] * 4 + [inspect.getsource(json), inspect.getsource(textwrap)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(path)


def _base(arch: str) -> tuple[str, dict]:
    common = dict(vocab_size=VOCAB, eos_token_id=EOS, bos_token_id=1, pad_token_id=0)
    llama = dict(common, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15,
                 tie_word_embeddings=False)
    table = {
        "llama": ("LlamaConfig", llama),
        "llama-mha-tied": ("LlamaConfig", dict(llama, num_key_value_heads=4, tie_word_embeddings=True)),
        "llama-rope-linear": ("LlamaConfig", dict(llama, rope_scaling={"rope_type": "linear", "factor": 2.0})),
        "llama-rope-llama3": ("LlamaConfig", dict(llama, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})),
        "llama-gqa8": ("LlamaConfig", dict(llama, num_attention_heads=8, num_key_value_heads=2, head_dim=16)),
        "mistral": ("MistralConfig", dict(llama, sliding_window=None)),
        "qwen2": ("Qwen2Config", dict(llama, use_sliding_window=False)),
        "gpt2": ("GPT2Config", dict(common, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                    initializer_range=0.15)),
        "gpt_neox": ("GPTNeoXConfig", dict(common, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, rotary_pct=0.25, use_parallel_residual=True,
                                           max_position_embeddings=256, initializer_range=0.15)),
        "gpt_neox-seq": ("GPTNeoXConfig", dict(common, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.5,
                                               use_parallel_residual=False, max_position_embeddings=256,
                                               initializer_range=0.15)),
        "opt": ("OPTConfig", dict(common, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=32,
                                  do_layer_norm_before=True, init_std=0.15)),
        "opt-350m-like": ("OPTConfig", dict(common, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                            num_attention_heads=4, max_position_embeddings=256,
                                            word_embed_proj_dim=32, do_layer_norm_before=False, init_std=0.15)),
        "mistral-swa": ("MistralConfig", dict(llama, sliding_window=16)),
        "qwen2-swa": ("Qwen2Config", dict(llama, use_sliding_window=True, sliding_window=16, max_window_layers=1)),
        # Odd sizes (tests/engine/test_odd_shapes.py): hidden, intermediate and head sizes off the vector widths.
        "llama-odd-h72": ("LlamaConfig", dict(llama, hidden_size=72, intermediate_size=150, num_attention_heads=6,
                                               num_key_value_heads=2)),  # head_dim 12, GQA 3
        "llama-odd-hd80": ("LlamaConfig", dict(llama, hidden_size=90, intermediate_size=200, num_attention_heads=6,
                                                num_key_value_heads=6, head_dim=80)),  # TP 2: 100 columns a rank
        "llama-odd-hd96": ("LlamaConfig", dict(llama, hidden_size=78, intermediate_size=300, num_attention_heads=6,
                                                num_key_value_heads=3, head_dim=96)),  # TP 3: 100 a rank, GQA 2
        "qwen3": ("Qwen3Config", dict(llama, head_dim=32, use_sliding_window=False)),
        # Every prompt is longer than original_max_position_embeddings: long factors and the attention factor.
        "phi3": ("Phi3Config", dict(llama, sliding_window=None, original_max_position_embeddings=2, rope_scaling={
            "rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)]})),
        # A sliding layer then a global one; small caps so the soft-capping really bends the logits.
        "gemma2": ("Gemma2Config", dict(llama, head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
                                        layer_types=["sliding_attention", "full_attention"],
                                        attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                        tie_word_embeddings=True)),
        "gemma3": ("Gemma3TextConfig", dict(llama, head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
                                            layer_types=["sliding_attention", "full_attention"],
                                            rope_theta=100000.0, rope_local_base_freq=10000.0,
                                            final_logit_softcapping=3.0, tie_word_embeddings=True)),
        "mixtral": ("MixtralConfig", dict(llama, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
        "qwen3_moe": ("Qwen3MoeConfig", dict(llama, head_dim=16, num_experts=6, num_experts_per_tok=2,
                                             moe_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1,
                                             mlp_only_layers=[1], use_sliding_window=False)),
    }
    return table[arch]


ARCHS = ["llama", "llama-mha-tied", "llama-rope-linear", "llama-rope-llama3", "mistral", "qwen2", "gpt2",
         "gpt_neox", "gpt_neox-seq", "opt", "opt-350m-like", "qwen3", "phi3", "gemma2", "gemma3", "mixtral",
         "qwen3_moe"]


def make_model(path: str, arch: str, seed: int = 0, tokenizer_dir: str | None = None, **overrides) -> str:
    import transformers

    cls_name, kwargs = _base(arch)
    config = getattr(transformers, cls_name)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    _perturb_biases_and_norms(model, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer_dir:
        for name in os.listdir(tokenizer_dir):
            with open(os.path.join(tokenizer_dir, name), "rb") as src, open(os.path.join(path, name), "wb") as dst:
                dst.write(src.read())
    return path


def _perturb_biases_and_norms(model, seed: int) -> None:
    """HF initialises biases to 0 and norms to 1; randomise them so their loading is really tested."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name or "layernorm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def load_hf_reference(model_dir: str, dtype: torch.dtype = torch.float32):
    """The transformers reference, with eager attention: the exact one (in some transformers versions SDPA is
    chosen for Gemma 2 and drops its attention logit soft-capping)."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int, hf_model=None):
    """HF generate(): greedy tokens (through the first EOS) and the raw logprob of each."""
    model = hf_model or load_hf_reference(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, eos_token_id=EOS,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens)]
    if EOS in tokens:
        cut = tokens.index(EOS) + 1
        tokens, logprobs = tokens[:cut], logprobs[:cut]
    return tokens, logprobs


def random_prompts(n: int, seed: int, min_len: int = 3, max_len: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lens]


def assert_all_blocks_free(llm_or_engine) -> None:
    engine = getattr(llm_or_engine, "llm_engine", llm_or_engine)
    sched = engine.core.scheduler
    bm = sched.block_manager
    assert not sched.has_unfinished(), "requests still queued"
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
    assert all(c == 0 for c in bm.pool.ref_cnt), "non-zero reference counts remain"


def assert_greedy_equals_hf(llm, model_dir: str, prompts: list[list[int]], max_tokens: int,
                            logprob_tol: float | None = 1e-4) -> None:
    """Greedy outputs of ``llm`` equal HF generate() at fp32, token for token (and each token's logprob within
    ``logprob_tol``, unless None)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=None if logprob_tol is None else 0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = load_hf_reference(model_dir)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        tokens, lps = hf_greedy(model_dir, p, max_tokens, hf)
        assert o.outputs[0].token_ids == tokens, f"prompt {i} diverged from HF"
        if logprob_tol is not None:
            ours = [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
            assert max(abs(a - b) for a, b in zip(ours, lps)) < logprob_tol


def load_as_rank(model_dir: str, monkeypatch, rank: int, tp: int):
    """The fp32 model as tensor-parallel rank ``rank`` of ``tp`` loads it (no process group: only the loading),
    and the checkpoint's full tensors by name."""
    cfg = load_model_config(model_dir, "float32", None, torch.device("cpu"))
    monkeypatch.setattr(parallel_state, "_TP_RANK", rank)
    monkeypatch.setattr(parallel_state, "_TP_SIZE", tp)
    model = load_model(cfg, torch.device("cpu"))
    with safe_open(cfg.weight_files[0], "pt") as f:
        return model, {k: f.get_tensor(k) for k in f.keys()}


def paged_case(q_lens, ctx_lens, gqa, block_size, head_size, dtype, seed, hkv=2, q_scale: float = 1.0):
    """A packed batch over a shuffled block pool: sequence b has ctx_lens[b] cached tokens and q_lens[b] new ones.
    Returns (query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    k = torch.randn(blocks, block_size, hkv, head_size, generator=g).to(dtype)
    v = torch.randn(blocks, block_size, hkv, head_size, generator=g).to(dtype)
    perm = torch.randperm(blocks, generator=g)
    table = torch.zeros(len(seq_lens), max(-(-n // block_size) for n in seq_lens), dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        table[i, :nb] = perm[used: used + nb]
        used += nb
    q = (q_scale * torch.randn(sum(q_lens), hkv * gqa, head_size, generator=g)).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, table, qsl, torch.tensor(seq_lens, dtype=torch.int32), head_size**-0.5
