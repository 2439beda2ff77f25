#!/usr/bin/env python
"""Train pagedserve's small bundled demo model (assets/demo-model/).

The model is a tiny Llama-architecture causal LM trained on CPU from scratch
on the Python standard library's own source code, so pagedserve can be tried
out of the box without downloading anything from a model hub.

Pipeline (everything seeded, step-bounded for reproducibility):
  1. corpus   : *.py files under sysconfig.get_paths()["stdlib"] (sorted),
                minus tests / idlelib / site-packages / generated data files;
                ~2% of the files (chosen by a seeded shuffle) are held out.
  2. tokenizer: byte-level BPE (``tokenizers``), vocab 4096, with the single
                special token <|endoftext|> as document separator / EOS / pad.
  3. model    : transformers.LlamaForCausalLM, hidden 256, 6 layers, 8 query
                heads / 4 KV heads (grouped-query attention), tied embeddings.
  4. training : AdamW + linear warmup + cosine decay, float32, 1 CPU thread,
                context 256, a fixed number of optimizer steps.
  5. eval     : mean token cross-entropy on the held-out files.
  6. export   : Hugging Face model directory (bfloat16 safetensors, tokenizer,
                generation config) plus a model card with greedy samples.

Usage:
  python assets/train_demo_model.py                      # full run
  python assets/train_demo_model.py --steps 20 --out /tmp/x   # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import sysconfig
import time
import tokenize
from pathlib import Path

import torch
import torch.nn.functional as F

EOS_TOKEN = "<|endoftext|>"
SAMPLE_PROMPTS = ["def __init__(self", "import os\n\ndef ", "class ", "for i in range("]

# Directory names (any path component) that are skipped entirely.
EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}


# --------------------------------------------------------------------------- #
# Corpus
# --------------------------------------------------------------------------- #
def is_generated_data_file(rel: Path, text: str) -> bool:
    """Files that are machine-generated data rather than hand-written code."""
    name = rel.name
    if name.startswith("_sysconfigdata"):  # build-machine specific paths
        return True
    if rel.parts[0] == "pydoc_data":  # ~750 KB of documentation strings
        return True
    if "Python Character Mapping Codec" in text[:500]:  # encodings/cp*.py tables
        return True
    return False


def collect_corpus(stdlib_dir: Path) -> list[tuple[str, str]]:
    """Return sorted (relative_path, source_text) pairs of the stdlib sources."""
    docs = []
    for path in sorted(stdlib_dir.rglob("*.py")):
        rel = path.relative_to(stdlib_dir)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if not path.is_file():
            continue
        try:
            # tokenize.open honours PEP 263 coding cookies.
            with tokenize.open(path) as fh:
                text = fh.read()
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        if not text.strip() or is_generated_data_file(rel, text):
            continue
        docs.append((rel.as_posix(), text))
    return docs


def split_corpus(docs, val_fraction: float, seed: int):
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(len(docs) * val_fraction))
    val_idx = set(order[:n_val])
    train = [d for i, d in enumerate(docs) if i not in val_idx]
    val = [d for i, d in enumerate(docs) if i in val_idx]
    return train, val


# --------------------------------------------------------------------------- #
# Tokenizer
# --------------------------------------------------------------------------- #
def train_tokenizer(train_texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # No prefix space: code must tokenize the same at the start of a prompt.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_texts, trainer=trainer, length=len(train_texts))
    return tok


def save_hf_tokenizer(tok, out_dir: Path, model_max_length: int):
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(out_dir)
    # Make the config explicit about the class so AutoTokenizer does not try to
    # infer a model-specific (e.g. SentencePiece-style Llama) tokenizer.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["eos_token"] = EOS_TOKEN
    cfg["pad_token"] = EOS_TOKEN
    cfg["bos_token"] = None
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    cfg["model_max_length"] = model_max_length
    cfg["clean_up_tokenization_spaces"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    for extra in ("special_tokens_map.json",):  # keep the directory minimal
        p = out_dir / extra
        if p.exists():
            p.unlink()


def encode_docs(tok, texts: list[str], eos_id: int) -> torch.Tensor:
    """Concatenate documents, each followed by <|endoftext|>, into one stream."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------- #
# Model / training
# --------------------------------------------------------------------------- #
def build_model(vocab_size: int, eos_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.02,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        use_cache=True,
    )
    model = LlamaForCausalLM(config)
    return model


class BatchSampler:
    """Non-overlapping (ctx+1)-token windows of the train stream, reshuffled
    every epoch with a random start offset; fully determined by the seed."""

    def __init__(self, stream: torch.Tensor, ctx: int, batch_size: int, seed: int):
        self.stream, self.ctx, self.bs = stream, ctx, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.epoch = 0
        self._new_epoch()

    def _new_epoch(self):
        offset = int(torch.randint(0, self.ctx, (1,), generator=self.gen))
        n = (len(self.stream) - offset - 1) // self.ctx
        self.starts = offset + self.ctx * torch.randperm(n, generator=self.gen)
        self.pos = 0

    def next(self):
        if self.pos + self.bs > len(self.starts):
            self.epoch += 1
            self._new_epoch()
        starts = self.starts[self.pos:self.pos + self.bs]
        self.pos += self.bs
        idx = starts[:, None] + torch.arange(self.ctx + 1)[None, :]
        chunk = self.stream[idx]
        return chunk[:, :-1], chunk[:, 1:]


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, ctx: int, batch_size: int) -> float:
    """Mean per-token cross-entropy over the whole stream (no overlap)."""
    model.eval()
    total_loss, total_tokens = 0.0, 0
    n_full = (len(stream) - 1) // ctx
    starts = [i * ctx for i in range(n_full)]
    for b in range(0, len(starts), batch_size):
        idx = torch.tensor(starts[b:b + batch_size])[:, None] + torch.arange(ctx + 1)[None, :]
        chunk = stream[idx]
        logits = model(input_ids=chunk[:, :-1]).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), chunk[:, 1:].reshape(-1),
                               reduction="sum")
        total_loss += loss.item()
        total_tokens += chunk[:, 1:].numel()
    tail_start = n_full * ctx
    if len(stream) - tail_start > 1:  # leftover partial window
        chunk = stream[tail_start:][None, :]
        logits = model(input_ids=chunk[:, :-1]).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), chunk[:, 1:].reshape(-1),
                               reduction="sum")
        total_loss += loss.item()
        total_tokens += chunk[:, 1:].numel()
    model.train()
    return total_loss / total_tokens


# --------------------------------------------------------------------------- #
# Export
# --------------------------------------------------------------------------- #
def greedy_samples(model_dir: Path, max_new_tokens: int) -> list[tuple[str, str]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    out = []
    for prompt in SAMPLE_PROMPTS:
        inputs = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        completion = tok.decode(gen[0, inputs["input_ids"].shape[1]:], skip_special_tokens=False)
        out.append((prompt, completion))
    return out, model


def write_model_card(out_dir: Path, info: dict, samples):
    lines = []
    lines.append("# pagedserve demo model")
    lines.append("")
    lines.append("A tiny Llama-architecture causal language model bundled with pagedserve so the "
                 "engine can be exercised out of the box, without downloading weights. It was "
                 "trained from scratch on CPU on the Python standard library's own source code; "
                 "it produces Python-flavoured text, not useful answers. It is a test fixture, "
                 "not a useful assistant.")
    lines.append("")
    lines.append("Reproduce with `python assets/train_demo_model.py` (exact numbers depend on the "
                 "local Python version's stdlib and on the CPU).")
    lines.append("")
    lines.append("## Training recipe")
    lines.append("")
    lines.append(f"- **Data**: `*.py` files under the stdlib of Python {info['python_version']} "
                 f"(`sysconfig.get_paths()['stdlib']`), sorted by path; excluding any "
                 f"`test`/`tests`/`idlelib`/`site-packages` directories and generated data files "
                 f"(`pydoc_data/`, `_sysconfigdata*`, `encodings` charmap tables). "
                 f"{info['n_files']} files ({info['corpus_mb']:.1f} MB); a seeded per-file split "
                 f"holds out {info['n_val_files']} files ({info['val_fraction']:.0%}) for "
                 f"validation. Each file is followed by `<|endoftext|>`.")
    lines.append(f"- **Tokenizer**: byte-level BPE (`tokenizers`, ByteLevel pre-tokenizer without "
                 f"prefix space + ByteLevel decoder) trained on the train files, vocab "
                 f"{info['vocab_size']}; `<|endoftext|>` (id {info['eos_id']}) is the only special "
                 f"token and serves as document separator, EOS and pad. No BOS token is added. "
                 f"Train stream: {info['train_tokens']:,} tokens; validation: "
                 f"{info['val_tokens']:,} tokens.")
    lines.append(f"- **Architecture**: `LlamaForCausalLM`, hidden {info['hidden']}, "
                 f"{info['layers']} layers, {info['heads']} attention heads with "
                 f"{info['kv_heads']} KV heads (grouped-query attention, head dim "
                 f"{info['head_dim']}), MLP intermediate {info['intermediate']}, RoPE theta "
                 f"10000, max_position_embeddings {info['max_pos']}, tied input/output "
                 f"embeddings. **{info['n_params']:,} parameters** "
                 f"({info['n_params'] / 1e6:.2f} M). Weights stored in bfloat16.")
    lines.append(f"- **Optimisation**: AdamW (betas 0.9/0.95, weight decay {info['wd']} on "
                 f"matrices, eps 1e-8), peak LR {info['lr']}, linear warmup {info['warmup']} steps "
                 f"then cosine decay to {info['min_lr_ratio']:.0%} of peak, grad-norm clip 1.0; "
                 f"batch {info['batch_size']} x context {info['ctx']} = "
                 f"{info['batch_size'] * info['ctx']:,} tokens/step; **{info['steps']} steps**, "
                 f"{info['tokens_seen']:,} tokens seen (~{info['epochs']:.2f} epochs). float32 "
                 f"on CPU, `torch.set_num_threads({info['threads']})`, seed {info['seed']}.")
    lines.append(f"- **Time**: {info['train_time_s'] / 60:.1f} min of optimisation "
                 f"({info['s_per_step']:.2f} s/step), {info['total_time_s'] / 60:.1f} min end to "
                 f"end, on {info['cpu']} (torch {info['torch_version']}, transformers "
                 f"{info['transformers_version']}).")
    lines.append("")
    lines.append("## Evaluation")
    lines.append("")
    lines.append(f"Mean token cross-entropy on the held-out files (non-overlapping "
                 f"{info['ctx']}-token windows): **{info['val_loss']:.4f} nats** (perplexity "
                 f"{math.exp(info['val_loss']):.1f}) in float32; {info['val_loss_bf16']:.4f} with "
                 f"the saved bfloat16 weights. Final training loss (mean of last 20 steps): "
                 f"{info['final_train_loss']:.4f}.")
    lines.append("")
    lines.append("## Greedy samples")
    lines.append("")
    lines.append("`model.generate(..., max_new_tokens=40, do_sample=False)` with the saved "
                 "bfloat16 weights; the prompt is shown followed by the completion.")
    lines.append("")
    for prompt, completion in samples:
        lines.append(f"Prompt `{prompt!r}`:")
        lines.append("")
        lines.append("```python")
        lines.append((prompt + completion).replace("```", "`` `"))
        lines.append("```")
        lines.append("")
    lines.append("## Usage")
    lines.append("")
    lines.append("```python")
    lines.append("from transformers import AutoModelForCausalLM, AutoTokenizer")
    lines.append("tok = AutoTokenizer.from_pretrained(\"assets/demo-model\")")
    lines.append("model = AutoModelForCausalLM.from_pretrained(\"assets/demo-model\")")
    lines.append("ids = tok(\"def __init__(self\", return_tensors=\"pt\")")
    lines.append("print(tok.decode(model.generate(**ids, max_new_tokens=40)[0]))")
    lines.append("```")
    lines.append("")
    (out_dir / "README.md").write_text("\n".join(lines))


# --------------------------------------------------------------------------- #
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = Path(__file__).resolve().parent
    ap.add_argument("--out", type=Path, default=here / "demo-model", help="output model directory")
    ap.add_argument("--steps", type=int, default=1400, help="number of optimizer steps")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=256, help="training context length")
    ap.add_argument("--lr", type=float, default=1.5e-3, help="peak learning rate")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--val-fraction", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=1234)
    # One intra-op thread: on the shared 2-vCPU build box, two OpenMP threads were
    # 3-5x *slower* per step whenever anything else ran (barrier stalls), and a
    # 2-thread fp32 matmul was not faster than a 1-thread one; one thread also
    # keeps step time predictable. Pass --threads 2 to use both cores anyway.
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args(argv)

    t_start = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    args.out.mkdir(parents=True, exist_ok=True)

    import transformers
    transformers.logging.set_verbosity_error()

    # 1. corpus ------------------------------------------------------------
    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    docs = collect_corpus(stdlib_dir)
    train_docs, val_docs = split_corpus(docs, args.val_fraction, args.seed)
    corpus_bytes = sum(len(t.encode("utf-8")) for _, t in docs)
    print(f"corpus: {len(docs)} files, {corpus_bytes / 1e6:.2f} MB from {stdlib_dir}; "
          f"train {len(train_docs)} / val {len(val_docs)} files", flush=True)

    # 2. tokenizer ---------------------------------------------------------
    t0 = time.time()
    tok = train_tokenizer([t for _, t in train_docs], args.vocab_size)
    eos_id = tok.token_to_id(EOS_TOKEN)
    vocab_size = tok.get_vocab_size()
    save_hf_tokenizer(tok, args.out, model_max_length=1024)
    train_stream = encode_docs(tok, [t for _, t in train_docs], eos_id)
    val_stream = encode_docs(tok, [t for _, t in val_docs], eos_id)
    print(f"tokenizer: vocab {vocab_size}, eos id {eos_id}, trained+encoded in "
          f"{time.time() - t0:.1f}s; train {len(train_stream):,} tokens, val "
          f"{len(val_stream):,} tokens ({corpus_bytes / (len(train_stream) + len(val_stream)):.2f} "
          f"bytes/token)", flush=True)

    # 3. model -------------------------------------------------------------
    torch.manual_seed(args.seed)
    model = build_model(vocab_size, eos_id)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    print(f"model: {n_params:,} parameters", flush=True)

    decay, no_decay = [], []
    for _, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    wd = 0.1
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = max(1, min(100, args.steps // 15))
    min_lr_ratio = 0.1
    sampler = BatchSampler(train_stream, args.ctx, args.batch_size, args.seed)

    # 4. training ----------------------------------------------------------
    losses = []
    t_train = time.time()
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, warmup, min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = sampler.next()
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps - 1:
            elapsed = time.time() - t_train
            sps = elapsed / (step + 1)
            print(f"step {step + 1:5d}/{args.steps} loss {loss.item():.4f} lr {lr:.2e} "
                  f"gnorm {gnorm:.2f} | {sps:.2f} s/step, elapsed {elapsed / 60:.1f} min, "
                  f"eta {sps * (args.steps - step - 1) / 60:.1f} min", flush=True)
    train_time = time.time() - t_train

    # 5. evaluation --------------------------------------------------------
    t0 = time.time()
    val_loss = evaluate(model, val_stream, args.ctx, batch_size=16)
    print(f"val loss (fp32): {val_loss:.4f} (ppl {math.exp(val_loss):.2f}) "
          f"[{time.time() - t0:.1f}s]", flush=True)

    # 6. export ------------------------------------------------------------
    from transformers import GenerationConfig

    model.config.use_cache = True
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id)
    model.to(torch.bfloat16).save_pretrained(args.out)
    for stale in ("pytorch_model.bin",):
        if (args.out / stale).exists():
            (args.out / stale).unlink()

    samples, reloaded = greedy_samples(args.out, max_new_tokens=40)
    val_loss_bf16 = evaluate(reloaded, val_stream, args.ctx, batch_size=16)
    print(f"val loss (saved bf16 weights): {val_loss_bf16:.4f}", flush=True)
    for prompt, completion in samples:
        print(f"--- {prompt!r}\n{prompt}{completion}", flush=True)

    tokens_seen = args.steps * args.batch_size * args.ctx
    info = dict(
        python_version=platform.python_version(), n_files=len(docs),
        corpus_mb=corpus_bytes / 1e6, n_val_files=len(val_docs), val_fraction=args.val_fraction,
        vocab_size=vocab_size, eos_id=eos_id, train_tokens=len(train_stream),
        val_tokens=len(val_stream), hidden=model.config.hidden_size,
        layers=model.config.num_hidden_layers, heads=model.config.num_attention_heads,
        kv_heads=model.config.num_key_value_heads, head_dim=model.config.head_dim,
        intermediate=model.config.intermediate_size,
        max_pos=model.config.max_position_embeddings, n_params=n_params, wd=wd, lr=args.lr,
        warmup=warmup, min_lr_ratio=min_lr_ratio, batch_size=args.batch_size, ctx=args.ctx,
        steps=args.steps, tokens_seen=tokens_seen, epochs=tokens_seen / len(train_stream),
        threads=args.threads, seed=args.seed, train_time_s=train_time,
        s_per_step=train_time / max(1, args.steps), total_time_s=time.time() - t_start,
        cpu=f"{os.cpu_count()} CPU cores ({platform.machine()})",
        torch_version=torch.__version__, transformers_version=transformers.__version__,
        val_loss=val_loss, val_loss_bf16=val_loss_bf16,
        final_train_loss=sum(losses[-20:]) / len(losses[-20:]),
    )
    write_model_card(args.out, info, samples)
    st = args.out / "model.safetensors"
    print(f"saved {args.out} (model.safetensors {st.stat().st_size / 1e6:.2f} MB); "
          f"total {info['total_time_s'] / 60:.1f} min", flush=True)


if __name__ == "__main__":
    sys.exit(main())
