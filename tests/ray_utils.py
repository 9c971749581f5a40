"""A local Ray head for the tests that a loaded 2-core machine cannot time out (issue 36).

`ray.init()` starts a head whose raylet, before it registers with the GCS, waits for its two
Python agents (dashboard agent, runtime-env agent) to write their port files, and aborts
("Timed out waiting for file .../metrics_agent_port_...") when they take more than ~15 s;
the driver then gives up 30 s after starting the raylet ("The current node timed out during
startup"). Both limits are hard-coded in Ray 2.60 (`RAY_agent_register_timeout_ms` does not
reach the first, nothing reaches the second), and both are spent importing Ray in Python
processes, which a busy 2-core machine can stretch past them.

`ray start --head` takes the agents' ports as flags, so its raylet registers at once and
the agents come up in their own time; workers that need the runtime-env agent wait for it up
to `RAY_agent_register_timeout_ms`, raised here. Ray also starts its workers, the test's
ranks, at nice 15, where any other load starves them: here at 0. The head runs with
`--block` in its own session and temporary directory (its logs, and its address file, which
a plain `ray.init()` elsewhere on the machine would otherwise connect to), under a token of
its own. A head that exits at once (a port taken meanwhile) is tried again on fresh ports;
one still not started after START_TIMEOUT_S is a clear error, with its logs, not a wait.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

START_TIMEOUT_S = 120  # for `ray start` to say "Ray runtime started" (~7 s on an idle machine)
START_ATTEMPTS = 3  # of heads that exit at once
STOP_TIMEOUT_S = 60
# inherited by the head and every Ray process, and by the test's engine core and actors
RAY_ENV = {
    "RAY_AUTH_MODE": "token",  # a token of this head's own (RAY_AUTH_TOKEN), not ~/.ray's
    "RAY_agent_register_timeout_ms": "300000",  # workers waiting for the runtime-env agent
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # SIGTERM: stop now, no 30 s drain
    "RAY_prestart_worker_first_driver": "0",  # no idle workers: actors get their own
    # Ray starts workers at nice 15, which any other load starves: here they are the ranks
    "RAY_worker_niceness": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}


@contextmanager
def local_ray_head(num_cpus: int) -> Iterator[RayHead]:
    """A running head of `num_cpus` CPUs, with RAY_ENV and its token in os.environ meanwhile
    (for this process's `ray.init(address=head.address)` and its children); the test fails
    with what went wrong when no head starts."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {**RAY_ENV, "RAY_AUTH_TOKEN": secrets.token_hex(32)}.items():
            mp.setenv(name, value)
        _reload_ray_auth()
        try:
            head = start_ray_head(num_cpus)
        except RuntimeError as e:
            pytest.fail(str(e), pytrace=False)
        try:
            yield head
        finally:
            head.stop()
    _reload_ray_auth()


def _reload_ray_auth() -> None:
    """This process's Ray reads RAY_AUTH_MODE and RAY_AUTH_TOKEN once: read them again (as
    Ray's own tests do when they change them)."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # a Ray without token authentication
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@dataclass
class RayHead:
    address: str
    proc: subprocess.Popen
    temp_dir: str
    output: list[str] = field(default_factory=list)

    def stop(self) -> None:
        """SIGTERM to `ray start --block` (it stops what it started), then SIGKILL to its
        process group if it is still there after STOP_TIMEOUT_S."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def start_ray_head(num_cpus: int) -> RayHead:
    """A running head of `num_cpus` CPUs, in os.environ's Ray settings; RuntimeError when
    START_ATTEMPTS heads exited at once or one did not start within START_TIMEOUT_S."""
    start, attempts = time.monotonic(), 0
    while True:
        attempts += 1
        head = _launch(num_cpus)
        problem = _wait_started(head)
        if problem is None:
            return head
        exited, last_words = head.proc.poll() is not None, _last_words(head)
        head.stop()
        if not exited or attempts == START_ATTEMPTS:  # a slow start is not tried again
            break
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    raise RuntimeError(
        f"no local Ray head after {attempts} attempt(s) in {time.monotonic() - start:.0f} s "
        f"(load average {load} on {os.cpu_count()} CPUs): {problem}\n{last_words}"
    )


def _launch(num_cpus: int) -> RayHead:
    ports = _free_ports(5)
    temp_dir = tempfile.mkdtemp(prefix="pagellm-ray-")  # short: Ray's socket paths go in it
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    flags = {
        "num-cpus": num_cpus, "num-gpus": 0, "include-dashboard": "false",
        "node-ip-address": "127.0.0.1", "temp-dir": temp_dir, "object-store-memory": 128 << 20,
        "port": ports[0], "metrics-export-port": ports[1], "dashboard-agent-grpc-port": ports[2],
        "dashboard-agent-listen-port": ports[3], "runtime-env-agent-port": ports[4],
    }  # fmt: skip
    cmd = [ray, "start", "--head", "--block", *(f"--{k}={v}" for k, v in flags.items())]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    return RayHead(f"127.0.0.1:{ports[0]}", proc, temp_dir)


def _wait_started(head: RayHead) -> str | None:
    """None once the head says it started; else what went wrong. Its output is read to the
    end on a thread (a full pipe would stop it)."""
    started, done = threading.Event(), threading.Event()

    def read() -> None:
        for line in head.proc.stdout:
            head.output.append(line)
            if "Ray runtime started" in line:
                started.set()
                done.set()
        done.set()  # the head closed its output: it is exiting

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(START_TIMEOUT_S):
        return f"`ray start` did not start within {START_TIMEOUT_S} s"
    if not started.is_set():
        try:
            return f"`ray start` exited with code {head.proc.wait(STOP_TIMEOUT_S)}"
        except subprocess.TimeoutExpired:
            return "`ray start` closed its output without starting"
    return None


def _last_words(head: RayHead) -> str:
    """The tail of `ray start`'s output and of the raylet's and GCS's error logs."""
    parts = ["".join(head.output[-15:])]
    for name in ("raylet.err", "gcs_server.err"):
        for path in glob.glob(os.path.join(head.temp_dir, "session_*", "logs", name)):
            with open(path, errors="replace") as f:
                parts.append(f"{name}: {f.read()[-1500:]}")
    return "\n".join(p for p in parts if p.strip())


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
