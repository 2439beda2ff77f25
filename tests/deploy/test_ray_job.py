"""`ray job submit` against a head started with `ray start --head` (token authentication on, as Ray's
default): the job runs the full serve-and-query demo (`pagedserve demo`) to completion."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from pagedserve.tests.server_thread import free_port, kill_ray_head

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ray_job_submit_runs_serve_and_query(llama_dir):
    bin_dir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"], RAY_AUTH_MODE="token")
    env.pop("RAY_ADDRESS", None)
    gcs_port, dash_port = free_port(), free_port()
    # Every fixed-default port gets a free one: the session's own Ray instance (conftest) already holds the
    # dashboard agent's 52365, and an agent that cannot bind cannot take jobs ("No available agent").
    ports = [f"--{name}={free_port()}" for name in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                       "metrics-export-port", "runtime-env-agent-port",
                                                       "ray-client-server-port")]
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths have a length limit
    # --block keeps `ray start` in the foreground; stopping it stops this head's processes only (unlike `ray stop`).
    head = subprocess.Popen([os.path.join(bin_dir, "ray"), "start", "--head", f"--port={gcs_port}",
                             f"--dashboard-port={dash_port}", *ports, "--num-cpus=4", "--block",
                             "--disable-usage-stats", f"--temp-dir={temp_dir}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    address = f"http://127.0.0.1:{dash_port}"
    try:
        deadline = time.monotonic() + 120
        while subprocess.run([os.path.join(bin_dir, "ray"), "job", "list", "--address", address], env=env,
                             capture_output=True).returncode != 0:
            assert head.poll() is None and time.monotonic() < deadline, "ray head did not come up"
            time.sleep(1)
        deadline = time.monotonic() + 60
        while True:
            job = subprocess.run([os.path.join(bin_dir, "ray"), "job", "submit", "--address", address,
                                  "--working-dir", REPO, "--", "pagedserve", "demo", "--model", llama_dir,
                                  "--max-tokens", "8", "class self", "def paged"],
                                 env=env, capture_output=True, text=True, timeout=300)
            out = job.stdout + job.stderr
            if "No available agent" not in out or time.monotonic() > deadline:  # the job agent starts last
                break
            time.sleep(1)
        assert job.returncode == 0, out[-4000:]
        assert "succeeded" in out and "Connected to Ray cluster" in out  # joined the head, did not start its own
        assert "[2 requests, 16 tokens" in out and "shut down cleanly" in out
    finally:
        kill_ray_head(head, temp_dir)
