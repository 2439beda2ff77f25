"""The private Ray head of a plain `serve`: a head that dies while starting is started again on fresh ports, the
dead one's processes are all gone, and the warning carries what the head printed. Run in a child process, which
becomes the head's driver as `serve` does; the head is killed for real (SIGKILL) before it is up."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

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
    answer = ray.get(ray.remote(lambda: 6 * 7).remote())
    first_session_left = [p.pid for p in psutil.process_iter() if os.getsid(p.pid) == killed["sid"]]
    head.stop()
    print(json.dumps({"answer": answer, "warnings": warnings, "first_session_left": first_session_left}))
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
