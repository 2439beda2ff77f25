"""The tiny tasks' documents, read from the JSON-lines files beside this one (nothing comes from a hub)."""
from __future__ import annotations

import json
import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def _docs(name: str) -> dict[str, datasets.Dataset]:
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return {"test": datasets.Dataset.from_list([json.loads(line) for line in f if line.strip()])}


def loglik_docs(**kwargs) -> dict[str, datasets.Dataset]:
    return _docs("tiny_loglik.jsonl")


def generate_docs(**kwargs) -> dict[str, datasets.Dataset]:
    return _docs("tiny_generate.jsonl")
