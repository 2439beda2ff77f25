from __future__ import annotations

import pytest
import torch

from pagedserve.tests.utils import make_model, make_tokenizer

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tokenizer"))
    make_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory, tokenizer_dir):
    """model_factory(arch, **config_overrides) -> model dir, built once per session."""
    cache: dict[tuple, str] = {}

    def build(arch: str, **overrides) -> str:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            path = str(tmp_path_factory.mktemp(arch))
            cache[key] = make_model(path, arch, tokenizer_dir=tokenizer_dir, **overrides)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def llama_dir(model_factory) -> str:
    return model_factory("llama")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for the whole session (started lazily by the first test that needs it)."""
    import ray

    # Logical CPUs: the gateway tests' replicas and the TP tests' ranks must not wait on each other.
    ray.init(num_cpus=8, log_to_driver=False)
    yield ray
    ray.shutdown()
