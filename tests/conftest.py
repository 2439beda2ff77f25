from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.tests.utils import backend_context, cpu_backend, make_model, make_tokenizer

torch.set_num_threads(2)

# The environment's own tools first on PATH, as an activated environment has them, for this process and all it
# starts (Ray's processes, the CLI runs, Ray jobs).
_ENV_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _ENV_BIN:
    os.environ["PATH"] = _ENV_BIN + os.pathsep + os.environ.get("PATH", "")

if not torch.cuda.is_available():
    # Triton kernels run in its CPU interpreter in this process. Triton decides that when a kernel is decorated, so
    # it is set here, before any test module imports one, whichever folders are collected; Ray's processes run
    # them as deployed (the `ray_cluster` fixture), where a Triton backend on CPU fails.
    os.environ["TRITON_INTERPRET"] = "1"

LAYERS = ("unit", "engine", "cluster", "deploy")  # the folders under tests/, lightest first


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test carries its folder's marker, so `-m unit` selects what `pytest tests/unit` runs; a test outside
    those folders is an error (it would escape every marker)."""
    root = Path(__file__).parent
    for item in items:
        parts = item.path.relative_to(root).parts if item.path.is_relative_to(root) else ()
        if not parts or parts[0] not in LAYERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in one of tests/{{{','.join(LAYERS)}}}/")
        item.add_marker(getattr(pytest.mark, parts[0]))


@pytest.fixture
def cpu_kernels():
    """Layers run alone on the C++ backend (the spec where the extension is not built), as a CPU worker runs them."""
    with backend_context(cpu_backend() if cpu_extension.available() else None):
        yield


@pytest.fixture(scope="module")
def load_benchmark():
    """load_benchmark(name) -> benchmarks/bench_<name>.py as a module, in sys.modules (its dataclasses look it up there)
    until the test module ends."""
    loaded: list[str] = []

    def load(name: str):
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", f"bench_{name}.py")
        spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        loaded.append(spec.name)
        spec.loader.exec_module(mod)
        return mod

    yield load
    for name in loaded:
        sys.modules.pop(name, None)


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
    # address="local": never a cluster some other process left running. No dashboard: no test uses it, and its
    # processes take CPU from the tests on a small host (as `serve`'s private Ray leaves it out).
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TRITON_INTERPRET": "0"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for localhost and 127.0.0.1, and its key."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = str(d / "cert.pem"), str(d / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key
