"""A Ray head for one server alone, in its own session.

``ray.init()`` would start Ray's processes (GCS, raylet, workers) in the server's process group, so a SIGTERM or
Ctrl-C meant for the group (a terminal, ``kill -TERM -PGID``, a supervisor) reached them too: Ray died first and
the draining server hung in teardown. Started in a session of its own, Ray outlives the signal while the server
drains, and ``stop()`` then ends every process of that session. If the server itself is killed, the kernel sends
the head SIGTERM (PR_SET_PDEATHSIG), and the head stops its processes.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import ray
from ray._private.authentication.authentication_token_setup import (
    enable_token_auth_by_default,
    ensure_token_if_auth_enabled,
)

from pagedserve.engine.executor.ray_utils import ray_env

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
START_TIMEOUT_S = 120.0
START_ATTEMPTS = 2
# What nobody can read on a private head, whose processes would take it from the engine on a small host: Ray's own
# metrics (exported through its dashboard agent, at ports nobody is told), workers started ahead for tasks the
# server never runs, and the log monitor (it copies workers' logs to drivers, and the driver here takes none; the
# files stay under the session's temp dir). Each is the operator's to turn back on through its environment variable.
LEAN_HEAD_ENV = {"RAY_enable_metrics_collection": "0", "RAY_enable_worker_prestart": "0",
                 "RAY_prestart_worker_first_driver": "0"}


class _HeadExited(Exception):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class PrivateRay:
    def __init__(self, num_cpus: int | None = None) -> None:
        self.num_cpus = num_cpus
        self.proc: subprocess.Popen | None = None
        self.temp_dir: str | None = None

    def start(self) -> None:
        """Start the head and connect this process to it as the driver. A head that dies while starting (one of
        Ray's processes lost a race for a port it picked itself, say) is started once more, on fresh ports."""
        for attempt in range(START_ATTEMPTS):
            try:
                self._start_once()
                return
            except _HeadExited as e:
                self.stop()
                if attempt + 1 == START_ATTEMPTS:
                    raise RuntimeError(str(e)) from None
                logger.warning("%s; starting it again", e)
            except BaseException:
                self.stop()
                raise

    def _start_once(self) -> None:
        port = _free_port()
        # Short: Ray's socket paths have a length limit. Fixed default ports would clash with another Ray on the host.
        self.temp_dir = tempfile.mkdtemp(prefix="psray", dir="/tmp")
        ports = [f"--{name}={_free_port()}" for name in (
            "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
            "runtime-env-agent-port", "ray-client-server-port")]
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
               "--include-dashboard=false", "--include-log-monitor=false", "--disable-usage-stats", "--block",
               f"--temp-dir={self.temp_dir}", *ports, *([f"--num-cpus={self.num_cpus}"] if self.num_cpus else [])]
        # Token authentication (unless RAY_AUTH_MODE=disabled), set up as ray.init() does for a local instance: token
        # mode for this process (and so for the head, which inherits the environment) and a token on disk.
        enable_token_auth_by_default()
        ensure_token_if_auth_enabled(None, create_token_if_missing=True)
        # `ray start` prints why it gave up (which of its processes exited, with the tail of that one's log).
        head_log = open(os.path.join(self.temp_dir, "head.log"), "wb")
        with head_log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=head_log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent,
                                         env={**LEAN_HEAD_ENV, **ray_env()})
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        # ray.init() against a GCS that is not up retries inside for minutes, blind to a head that has died: connect
        # only once the GCS port answers, watching the head until then.
        while not _accepts(port):
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the private Ray head did not come up in {START_TIMEOUT_S:.0f} s; it printed:\n"
                                   f"{self._head_output()}")
            time.sleep(0.2)
        while True:
            self._check_alive()
            try:
                ray.init(address=address, log_to_driver=False)
                break
            except (ConnectionError, TimeoutError, ray.exceptions.RaySystemError) as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the private Ray head did not come up in {START_TIMEOUT_S:.0f} s: {e}") from e
                time.sleep(0.5)
        logger.info("private Ray head at %s (session %d)", address, self.proc.pid)

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise _HeadExited(f"the private Ray head exited with {self.proc.returncode} while starting; it printed:\n"
                              f"{self._head_output()}")

    def _head_output(self, limit: int = 4000) -> str:
        assert self.temp_dir is not None
        with open(os.path.join(self.temp_dir, "head.log"), "rb") as f:
            return f.read().decode(errors="replace")[-limit:]

    def stop(self, timeout: float = 20.0) -> None:
        """Disconnect, stop the head (it stops its processes), then kill whatever of its session is left."""
        if ray.is_initialized():
            ray.shutdown()
        if self.proc is not None:
            sid = self.proc.pid  # the session leader's pid is the session id
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    logger.warning("the private Ray head did not stop in %.0f s; killing it", timeout)
            for p in psutil.process_iter(["pid"]):
                try:
                    if os.getsid(p.info["pid"]) == sid:
                        p.kill()
                except (ProcessLookupError, PermissionError, psutil.Error):
                    pass
            self.proc = None
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None
