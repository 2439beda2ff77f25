"""benchmarks/bench_common.py's CPU description, which every result carries: machines of one kind have been Zen 4 and
Zen 5 EPYCs and Xeons, whose matmul rates differ 2x, so results must say which."""
from __future__ import annotations

import io
import platform

import pytest

CPUINFO = "/proc/cpuinfo"
L1D = "/sys/devices/system/cpu/cpu0/cache/index0/size"
ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9454 48-Core Processor
flags\t\t: fpu vme avx512f

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: not the first processor
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd
CPU implementer\t: 0x41
CPU part\t: 0xd0c
"""


@pytest.fixture(scope="module")
def common(load_benchmark):
    return load_benchmark("common")


def fake_files(monkeypatch, common, files: dict[str, str]) -> None:
    """cpu_description() reads these texts instead of the machine's; any other path is missing."""
    def fake_open(path, *args, **kwargs):
        if path not in files:
            raise FileNotFoundError(path)
        return io.StringIO(files[path])

    monkeypatch.setattr(common, "open", fake_open, raising=False)


def test_names_the_first_processors_model_family_and_l1d(common, monkeypatch):
    fake_files(monkeypatch, common, {CPUINFO: ZEN4, L1D: "32K\n"})
    assert common.cpu_description() == "AMD EPYC 9454 48-Core Processor (family 25 model 17), L1d 32K"


def test_a_cpuinfo_without_model_lines_still_gives_the_l1d(common, monkeypatch):
    fake_files(monkeypatch, common, {CPUINFO: ARM, L1D: "64K"})
    assert common.cpu_description() == "? (family ? model ?), L1d 64K"


def test_without_proc_and_sys_falls_back_to_platform(common, monkeypatch):
    fake_files(monkeypatch, common, {})
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert common.cpu_description() == platform.machine()
    monkeypatch.setattr(platform, "processor", lambda: "x86_64 Family 25")
    assert common.cpu_description() == "x86_64 Family 25"


def test_this_machine_is_described_on_one_line(common):
    desc = common.cpu_description()
    assert desc.strip() and "\n" not in desc, desc
    if platform.machine() == "x86_64":  # x86 kernels always report both
        assert "(family ?" not in desc and "model ?)" not in desc, desc
