"""Driving `pagellm serve` from tests: start it as a real subprocess on loopback, wait for it,
stop it as a supervisor would (SIGTERM), and read its metrics and errors."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest
from timing import scaled, wait_until

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
START_TIMEOUT_S = 150


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def child_pids(self) -> dict[int, str]:
        """pid -> command line of the server's child processes."""
        children = {}
        for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
            if stat(pid)[1:2] == [str(self.proc.pid)]:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        children[pid] = f.read().replace(b"\0", b" ").decode()
                except OSError:
                    pass
        return children

    def engine_pids(self) -> list[int]:
        """The server's engine core processes (the serving one and a spare), oldest first."""
        children = [
            (int(fields[19]), pid)  # (start time, pid)
            for pid, cmd in self.child_pids().items()
            if "sandbox_worker" not in cmd and (fields := stat(pid, all_fields=True))
        ]
        return [pid for _, pid in sorted(children)]

    def engine_pid(self) -> int:
        """The serving core: the oldest child (a spare starts after it)."""
        return self.engine_pids()[0]

    def spare_pid(self, timeout: float = START_TIMEOUT_S, ready: bool = True) -> int:
        """The latest spare engine core, once it is ready (or started), as the log says."""
        deadline = time.monotonic() + scaled(timeout)
        while time.monotonic() < deadline:
            log = self.log()
            started = re.findall(r"spare engine core (\d+) started", log)
            if started and (not ready or f"spare engine core {started[-1]} ready" in log):
                return int(started[-1])
            time.sleep(0.25)
        pytest.fail(f"no spare engine core within {timeout} s:\n{self.log()[-4000:]}")

    def sandbox_pids(self, lane: str = "") -> set[int]:
        """The chat-template sandbox's workers (of one lane)."""
        return {
            pid
            for pid, cmd in self.child_pids().items()
            if "sandbox_worker" in cmd and f'"name":"{lane}' in cmd
        }


def stat(pid: int, all_fields: bool = False) -> list[str]:
    """State and parent pid of a live process (`all_fields`: every field from the state on);
    [] if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return []
    return [] if fields[0] == "Z" else fields if all_fields else fields[:2]


def start_server(args: list[str], log_path: str) -> Server:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pagellm", "serve", "--port", str(port), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return Server(f"http://127.0.0.1:{port}", proc, log_path)


def wait_healthy(server: Server, timeout: float = START_TIMEOUT_S) -> None:
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"the server exited with {server.proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    pytest.fail(f"the server was not healthy within {timeout} s:\n{server.log()[-4000:]}")


def stop_server(server: Server, expect_engine: bool = True) -> None:
    """SIGTERM, as a user's Ctrl-C or a supervisor would; the engine process and the sandbox's
    workers must go too."""
    children = list(server.child_pids())
    assert server.engine_pids() or not expect_engine, "the server has no engine core process"
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(timeout=scaled(30))
    except subprocess.TimeoutExpired:
        server.proc.kill()  # leave nothing behind, then fail
        pytest.fail(f"the server ignored SIGTERM:\n{server.log()[-4000:]}")
    assert code in (0, -signal.SIGTERM), server.log()[-4000:]
    assert "Traceback" not in server.log(), server.log()[-4000:]
    gone = wait_until(lambda: not any(stat(pid) for pid in children), 10, interval=0.1)
    assert gone, f"orphan processes: {children}"


def metrics(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    lines = re.finditer(r"^([a-zA-Z0-9_:]+)(?:\{[^}]*\})? (\S+)$", text, re.M)
    return {m.group(1): float(m.group(2)) for m in lines}


def post(server: Server, path: str, body: object, headers: dict | None = None) -> httpx.Response:
    """POST JSON (a str body is sent as it is), with the API key unless `headers` says else."""
    data = body if isinstance(body, str) else json.dumps(body)
    hdrs = {"Content-Type": "application/json", **(AUTH if headers is None else headers)}
    return httpx.post(f"{server.url}{path}", content=data, headers=hdrs, timeout=60)


def error_of(response: httpx.Response, status: int) -> dict:
    """The OpenAI-shaped error of a response that must have this status."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def wait_kv_free(server: Server, timeout: float = 5.0) -> None:
    """Until no request runs or waits and no KV block is in use; fails after `timeout` (an
    idle machine's, scaled by the load: `timing.wait_until`)."""
    m: dict[str, float] = {}

    def free() -> bool:
        m.update(metrics(server))
        idle = m["pagellm:num_requests_running"] == 0 and m["pagellm:num_requests_waiting"] == 0
        return idle and m["pagellm:kv_cache_usage_perc"] == 0

    if not wait_until(free, timeout):
        pytest.fail(f"KV blocks still in use {timeout} s (scaled) after the client left: {m}")
