"""Loading the tokenizer that goes with a model dir."""
from __future__ import annotations

from transformers import AutoTokenizer


def load_tokenizer(name: str):
    return AutoTokenizer.from_pretrained(name)
