"""deploy/container/Containerfile keeps what the Helm chart and the CI container run rely on (read, not built: the
build and the containers run in deploy/container/build_ci_image.sh, which takes minutes)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = (REPO / "deploy" / "container" / "Containerfile").read_text()
CHART_VALUES = yaml.safe_load((REPO / "deploy" / "helm" / "pagedserve" / "values.yaml").read_text())


def instructions(name: str) -> list[str]:
    """The arguments of every NAME instruction, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", CONTAINERFILE)
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.*)$", text, re.MULTILINE)]


def test_entrypoint_is_tini_then_pagedserve():
    # The chart passes only arguments in single-node mode, and runs tini itself on the KubeRay pods.
    assert [json.loads(e) for e in instructions("ENTRYPOINT")] == [["tini", "--", "pagedserve"]]


def test_runs_as_the_charts_non_root_user():
    assert instructions("USER") == ["10001:10001"]
    assert CHART_VALUES["podSecurityContext"]["runAsUser"] == 10001


def test_exposes_the_charts_ports():
    exposed = {int(p) for e in instructions("EXPOSE") for p in e.split()}
    server = CHART_VALUES["server"]
    assert exposed == {server["grpcPort"], server["httpApi"]["port"], server["metricsPort"]}


def test_healthcheck_runs_pagedserve_health():
    (check,) = instructions("HEALTHCHECK")
    assert "CMD pagedserve health --server" in check and "--start-period=" in check


def test_kernel_cache_is_where_the_chart_mounts_one():
    assert "TORCH_EXTENSIONS_DIR=/var/cache/pagedserve/torch_extensions" in CONTAINERFILE
    code = "\n".join(line for line in CONTAINERFILE.splitlines() if not line.lstrip().startswith("#"))
    assert "-march" not in code and "cpu_attention" not in code  # not prebuilt: built where it runs, at first start


def test_base_torch_and_ca_are_build_inputs():
    assert instructions("ARG")[0].startswith("BASE_IMAGE=docker.io/library/python:3.11-slim")
    assert "FROM scratch AS torch-wheels" in CONTAINERFILE
    assert "--mount=type=secret,id=extra_ca" in CONTAINERFILE
