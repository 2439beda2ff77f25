"""The C++ kernels' build: every source in csrc/ is compiled, and a failed build is one clear error."""
import pytest
import torch.utils.cpp_extension

from pagedserve.kernels.backend import KernelBackend
from pagedserve.kernels.cpu import extension as cpu_extension
from pagedserve.kernels.select import select_backend

COMPILER_OUTPUT = """Error building extension 'pagedserve_cpu_kernels': [1/7] c++ -MMD -MF fused.o.d ... -c fused.cpp
/src/kernels/cpu/csrc/fused.cpp:12:3: error: 'rms_rows' was not declared in this scope
ninja: build stopped: subcommand failed."""


def test_every_source_is_built():
    assert sorted(cpu_extension.SOURCES) == sorted(p.name for p in cpu_extension.CSRC.glob("*.cpp"))


def test_failed_build_names_the_fallback(monkeypatch):
    def fail(**_):
        raise RuntimeError(COMPILER_OUTPUT)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fail)
    monkeypatch.setattr(cpu_extension, "_module", None)
    monkeypatch.setattr(cpu_extension, "_error", None)
    with pytest.raises(cpu_extension.KernelBuildError) as first:
        cpu_extension.load()
    message = str(first.value)
    assert "'rms_rows' was not declared" in message
    assert 'attention_backend="torch"' in message and "--attention-backend torch" in message
    assert "compiler" in message and "ninja" in message

    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **_: pytest.fail("a failed build is not retried"))
    with pytest.raises(cpu_extension.KernelBuildError) as again:
        cpu_extension.load()
    assert again.value is first.value
    assert not cpu_extension.available()
    cpu = torch.device("cpu")
    with pytest.raises(cpu_extension.KernelBuildError):
        select_backend("cpu", cpu, torch.float32)
    assert type(select_backend("torch", cpu, torch.float32)) is KernelBackend
