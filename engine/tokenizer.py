"""Loading the tokenizer that goes with a model dir, and its llguidance form for structured output."""
from __future__ import annotations

import llguidance
import llguidance.hf
from transformers import AutoTokenizer


def load_tokenizer(name: str):
    return AutoTokenizer.from_pretrained(name)


def guidance_tokenizer(tokenizer, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a fast HF tokenizer, over the model's whole vocabulary (its logits' width); ~0.1 s for
    a 4k vocabulary, more for large ones, so build it once."""
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
