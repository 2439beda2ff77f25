"""The image deploy/container/build_ci_image.sh builds keeps what the Helm chart relies on: arguments alone reach
`pagedserve` under tini, it runs as the chart's user with its home where the chart mounts one (the chart's root
filesystem is read-only), exposes the chart's ports, and has an empty, writable kernel cache where the chart mounts
one (the CPU kernel is built on the host that runs it). .ci/run runs this file against
the image it just built (PAGEDSERVE_IMAGE); elsewhere it skips. The build script itself proves that the image builds
from its inputs (base image, torch wheels, CA secret), runs the demo, serves, passes its HEALTHCHECK and drains on
SIGTERM, so none of that is repeated here."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_VALUES = yaml.safe_load((REPO / "deploy" / "helm" / "pagedserve" / "values.yaml").read_text())
KERNEL_CACHE = CHART_VALUES["scratch"]["kernelCache"]["mountPath"]  # the chart's kernel-cache emptyDir
HOME = CHART_VALUES["scratch"]["home"]["mountPath"]  # the chart's $HOME emptyDir
IMAGE = os.environ.get("PAGEDSERVE_IMAGE")
RUNTIME = shutil.which("podman") or shutil.which("docker")

pytestmark = pytest.mark.skipif(
    not (IMAGE and RUNTIME),
    reason="needs PAGEDSERVE_IMAGE (a built image) and podman or docker: .ci/run sets it after build_ci_image.sh")


# The container settings the build script runs its containers with (ulimits this sandbox allows, runc).
ENV = dict(os.environ, CONTAINERS_CONF=str(REPO / "deploy" / "container" / "containers.conf"))


def run(*args: str, entrypoint: str | None = None) -> str:
    """The image run as the chart runs it (its own user, no extra flags); its stdout."""
    cmd = [RUNTIME, "run", "--rm", "--no-healthcheck"] + (["--entrypoint", entrypoint] if entrypoint else [])
    proc = subprocess.run([*cmd, IMAGE, *args], capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def config() -> dict:
    out = subprocess.run([RUNTIME, "image", "inspect", IMAGE], capture_output=True, text=True, check=True,
                         env=ENV).stdout
    return json.loads(out)[0]["Config"]


def test_arguments_alone_reach_pagedserve_under_tini(config):
    # The chart passes only arguments in single-node mode, and runs tini itself on the KubeRay pods.
    assert config["Entrypoint"][:2] == ["tini", "--"]
    assert run("--help").startswith("usage: pagedserve ")


def test_runs_as_the_charts_non_root_user():
    ctx = CHART_VALUES["podSecurityContext"]
    assert run("-c", "id -u; id -g", entrypoint="sh").split() == [str(ctx["runAsUser"]), str(ctx["runAsGroup"])]


def test_home_is_where_the_chart_mounts_it():
    # The chart runs the root read-only with HOME on an emptyDir: the image's user has the same home, so the
    # image alone (podman --read-only --tmpfs HOME) and the chart write to the same places.
    assert run("-c", 'echo "$HOME"; id -un', entrypoint="sh").split() == [HOME, "pagedserve"]


def test_exposes_the_charts_ports(config):
    server = CHART_VALUES["server"]
    exposed = {int(p.split("/")[0]) for p in config["ExposedPorts"]}
    assert exposed == {server["grpcPort"], server["httpApi"]["port"], server["metricsPort"]}


def test_kernel_cache_is_where_the_chart_mounts_one_writable_and_empty():
    # Not prebuilt: the kernel is compiled with -march=native, so on the host that runs it, at first start.
    out = run("-c", 'echo "$TORCH_EXTENSIONS_DIR"; test -w "$TORCH_EXTENSIONS_DIR" && ls -A "$TORCH_EXTENSIONS_DIR"',
              entrypoint="sh")
    assert out.splitlines() == [KERNEL_CACHE]
