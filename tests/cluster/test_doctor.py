"""Preflight (`pagedserve doctor`, and `serve` on each replica's node) on the session's Ray cluster.

A bad interface name reaches the checks the way it reaches the ranks on a cluster someone else started: through the
job's runtime env. The CLI runs here get it as `ray job submit --runtime-env-json '{"env_vars": {...}}' -- pagedserve
...` gives it to its entrypoint (RAY_JOB_CONFIG_JSON_ENV_VAR, which `ray.init` merges into the job's runtime env); a
variable set in the driver's shell alone would not reach the session's workers, nor a real cluster's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from pagedserve.cluster.entrypoints.cli import main
from pagedserve.cluster.runtime.memory_plan import available_memory
from pagedserve.cluster.runtime.preflight import (
    check_network,
    check_shm,
    local_versions,
    run_doctor,
)
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.executor.ray_utils import make_placement_group
from pagedserve.tests.server_thread import free_port

PS = [sys.executable, "-m", "pagedserve"]
CHECKS = ("network", "shm", "versions", "model", "memory")


def _job_env(ray_cluster, **env_vars: str) -> dict[str, str]:
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    env.pop("GLOO_SOCKET_IFNAME", None)
    env.pop("NCCL_SOCKET_IFNAME", None)
    if env_vars:
        env["RAY_JOB_CONFIG_JSON_ENV_VAR"] = json.dumps({"runtime_env": {"env_vars": env_vars}, "metadata": {}})
    return env


@pytest.fixture(scope="module", autouse=True)
def cli_runs(ray_cluster, llama_dir):
    """The CLI runs with a bad interface name, started together with the module (each is mostly imports and
    waiting, so the in-process tests run meanwhile) and awaited by their tests, the last ones."""
    bad = _job_env(ray_cluster, GLOO_SOCKET_IFNAME="nope0")
    procs = {
        "doctor-bad-ifname": (PS + ["doctor", llama_dir], bad),
        "serve-bad-ifname": (PS + ["serve", llama_dir, "--host", "127.0.0.1", "--grpc-port", str(free_port()),
                                   "--port", str(free_port()), "--metrics-port", str(free_port())], bad),
    }
    started = {k: (time.monotonic(), subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                      text=True)) for k, (cmd, env) in procs.items()}

    def result(name: str) -> tuple[int, str, str, float]:
        t0, proc = started[name]
        out, err = proc.communicate(timeout=180)
        return proc.returncode, out, err, time.monotonic() - t0

    yield result
    for _, proc in started.values():
        if proc.poll() is None:
            proc.kill()


def test_doctor_passes_on_this_machine(ray_cluster, llama_dir, capsys):
    """The command as `pagedserve doctor MODEL` runs it, in this process (joined to the session's Ray cluster)."""
    rc = main(["doctor", llama_dir])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    for name in CHECKS:
        assert sum(f" {name} " in ln and " OK " in ln for ln in lines) == 1, out  # one node, one line a check
    assert "ranks meet at " in out and "all checks passed" in lines[-1]


def test_doctor_fails_on_a_version_mismatch(ray_cluster, llama_dir):
    """A driver whose versions differ from the node's. Installing a second pagedserve on this machine is not
    possible, so the driver's side is what differs: ``run_doctor`` compares each node's real versions (read in the
    Ray task on that node) against the versions it is given, which are the driver's by default; here the driver's
    with another pagedserve version, as a driver installed from another release would send."""
    mine = local_versions()
    report = run_doctor(EngineArgs(model=llama_dir), expected_versions={**mine, "pagedserve": "0.0.1"})
    assert not report.ok
    versions = next(c for c in report.nodes[0].checks if c.name == "versions")
    assert not versions.ok
    assert versions.detail == f"pagedserve {mine['pagedserve']} here, 0.0.1 on the driver"
    assert "install the same versions on every node" in versions.fix
    assert [c.name for n in report.nodes for c in n.checks if not c.ok] == ["versions"]
    assert run_doctor(EngineArgs(model=llama_dir)).ok  # and the same nodes against this driver's own versions


def test_kv_plan_fails_when_the_kv_cache_exceeds_memory_or_holds_no_block(ray_cluster, llama_dir):
    too_big = 4 * available_memory()
    report = run_doctor(EngineArgs(model=llama_dir, kv_cache_memory=too_big))
    memory = next(c for c in report.nodes[0].checks if c.name == "memory")
    assert not memory.ok and "does not fit" in memory.detail
    assert "lower --kv-cache-memory-bytes (at most " in memory.fix

    report = run_doctor(EngineArgs(model=llama_dir, kv_cache_memory=1))  # the engine would refuse to start
    memory = next(c for c in report.nodes[0].checks if c.name == "memory")
    assert not memory.ok and "holds not one block" in memory.detail and "raise --kv-cache-memory-bytes" in memory.fix

    report = run_doctor(EngineArgs(model=llama_dir, num_gpu_blocks_override=4))  # small, as tests run: a note only
    memory = next(c for c in report.nodes[0].checks if c.name == "memory")
    assert memory.ok and "(64 tokens a rank)" in memory.detail and "longer requests will be refused" in memory.detail


def test_bad_engine_flags_are_a_failed_check_not_a_crash(ray_cluster, tmp_path):
    report = run_doctor(EngineArgs(model=str(tmp_path / "missing")))
    assert not report.ok and not report.checks[0].ok and "does not exist" in report.checks[0].detail
    assert {c.name for c in report.nodes[0].checks} == {"network", "shm", "versions"}


def test_interface_names_as_gloo_and_nccl_read_them():
    interfaces = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.5"], "eth1": [], "docker0": ["172.17.0.1"]}
    ok = check_network({"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "^lo,docker"}, "10.0.0.5", interfaces)
    assert [c.ok for c in ok] == [True, True] and "eth0 (10.0.0.5)" in ok[0].detail
    bare = check_network({"GLOO_SOCKET_IFNAME": "eth0,eth1"}, "10.0.0.5", interfaces)[0]
    assert not bare.ok and "eth1 has no address" in bare.detail and "export GLOO_SOCKET_IFNAME=eth0" in bare.fix
    exact = check_network({"NCCL_SOCKET_IFNAME": "=eth"}, "10.0.0.5", interfaces)[0]
    assert not exact.ok and "no interface named =eth" in exact.detail
    assert check_network({"NCCL_SOCKET_IFNAME": "eth"}, "10.0.0.5", interfaces)[0].ok  # a prefix
    unset = check_network({}, "10.0.0.5", interfaces)[0]
    assert unset.ok and "ranks meet at 10.0.0.5 (eth0)" in unset.detail


def test_small_shm_fails_with_the_fix():
    check = check_shm(minimum=1 << 50)
    assert not check.ok and "--shm-size" in check.fix and "medium: Memory" in check.fix


def test_placement_timeout_names_what_was_asked_and_what_the_cluster_has(ray_cluster):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        make_placement_group([{"CPU": 1000.0}], "toobig", timeout=1.0)
    assert time.monotonic() - t0 < 10
    why = str(e.value)
    cpus = ray_cluster.cluster_resources()["CPU"]
    assert "was not placed in 1 s: it needs 1000 CPU on one node" in why
    assert f"the cluster has {cpus:g} CPU" in why and f"no more than {cpus:g} CPU on any of its 1 node(s)" in why
    assert not [pg for pg in ray_cluster.util.placement_group_table().values()
                if pg["state"] == "CREATED" and "toobig" in pg["name"]]


def test_doctor_names_the_interfaces_and_the_fix_for_a_bad_interface_name(cli_runs):
    rc, out, err, _ = cli_runs("doctor-bad-ifname")
    assert rc == 1, out + err[-3000:]
    line = next(ln for ln in out.splitlines() if " network " in ln)
    assert " FAIL " in line and "GLOO_SOCKET_IFNAME=nope0: no interface named nope0" in line
    assert "lo (127.0.0.1" in line  # the interfaces that exist, with their addresses
    assert "fix: export GLOO_SOCKET_IFNAME=" in line
    assert all(" FAIL " not in ln for ln in out.splitlines() if " network " not in ln and "node(s)" not in ln), out


def test_serve_with_a_bad_interface_name_fails_before_loading(cli_runs, ray_cluster):
    rc, _, err, took = cli_runs("serve-bad-ifname")
    assert rc == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: preflight failed for replica 0 on "), err[-3000:]
    assert "no interface named nope0" in last and "fix: export GLOO_SOCKET_IFNAME=" in last
    assert "ready: serving" not in err and took < 120
    leftover = [pg for pg in ray_cluster.util.placement_group_table().values() if pg["state"] == "CREATED"
                and pg["name"].startswith("pagedserve-replica")]
    assert not leftover, leftover
