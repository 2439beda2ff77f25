"""The private Ray head of a plain `serve`: a head that dies while starting is started again on fresh ports, the
dead one's processes are all gone, and the warning carries what the head printed. Run in a child process, which
becomes the head's driver as `serve` does; the head is killed for real (SIGKILL) before it is up. The head that
comes up is lean: no workers started ahead, no log monitor."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

from pagedserve.tests.server_thread import free_port

SCRIPT = textwrap.dedent("""
    import json, logging, os, signal, threading, time
    import psutil, ray
    from pagedserve.cluster.runtime.private_ray import PrivateRay

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("pagedserve.cluster.runtime.private_ray").addHandler(handler)
    killed = {}

    def kill_first_head():
        while not killed:
            for p in psutil.Process().children():
                if "--head" in p.cmdline():
                    killed["sid"] = os.getsid(p.pid)
                    p.send_signal(signal.SIGKILL)
                    break
            time.sleep(0.05)

    threading.Thread(target=kill_first_head, daemon=True).start()
    head = PrivateRay(num_cpus=1)
    head.start()
    time.sleep(2)  # workers started ahead would be up by now
    lean = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == os.getsid(head.proc.pid) and p.cmdline():
                lean.append(p.cmdline())
        except (psutil.Error, ProcessLookupError):  # gone meanwhile
            pass
    answer = ray.get(ray.remote(lambda: 6 * 7).remote())
    first_session_left = [p.pid for p in psutil.process_iter() if os.getsid(p.pid) == killed["sid"]]
    head.stop()
    print(json.dumps({"answer": answer, "warnings": warnings, "first_session_left": first_session_left,
                      "lean": lean}))
""")


def test_a_head_killed_while_starting_is_started_again():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["answer"] == 42
    assert result["first_session_left"] == []
    assert len(result["warnings"]) == 1
    assert "exited with -9 while starting" in result["warnings"][0]
    assert "starting it again" in result["warnings"][0]
    # Lean: no worker waits for tasks the server never runs, no log monitor copies logs to a driver taking none.
    programs = [c[0] if c[0].startswith("ray::") else " ".join(os.path.basename(a) for a in c[:3])
                for c in result["lean"]]
    assert any(p.startswith("raylet") for p in programs), programs
    assert not [p for p in programs if p.startswith(("ray::IDLE", "ray::Worker")) or "log_monitor.py" in p], programs



def test_without_an_address_ray_starts_its_own_instance_despite_a_stale_address_file():
    """`generate -tp 2` or `LLM(tensor_parallel_size=2)` with no address start a Ray of their own. ray.init's
    default would join the instance named in <ray temp dir>/ray_current_cluster, which `ray start` and
    `ray.cluster_utils.Cluster` write and a killed run leaves behind: here it names a port nothing listens on."""
    temp = tempfile.mkdtemp(prefix="psr", dir="/tmp")  # short: Ray's socket paths have a length limit
    try:
        os.makedirs(os.path.join(temp, "ray"))
        with open(os.path.join(temp, "ray", "ray_current_cluster"), "w") as f:
            f.write(f"127.0.0.1:{free_port()}")
        script = ("import ray; from pagedserve.engine.executor.ray_utils import ensure_ray; ensure_ray(); "
                  "print('answer', ray.get(ray.remote(lambda: 6 * 7).remote())); ray.shutdown()")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": temp}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip().splitlines()[-1] == "answer 42"
    finally:
        shutil.rmtree(temp, ignore_errors=True)
