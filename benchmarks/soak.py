"""Soak `pagellm serve`: many streaming clients, random disconnects, a killed engine core.

    python benchmarks/soak.py                       # 200 clients, 1,000 requests, kill at 500
    python benchmarks/soak.py --clients 20 --requests 60 --kill-at 30   # a quick look

It starts a server on the embedded model with `--restart-engine` (or uses `--url`, whose core
it cannot kill), runs `--requests` streamed completions from `--clients` concurrent clients, a
fraction of which leave after a few chunks, SIGKILLs the serving engine core (not the spare)
when `--kill-at` requests have started, and checks what a server must survive:
- no request lost without an error: each one ends with `[DONE]` after its finish_reason, or with
  an error (in the stream or as an HTTP status), unless the client left; a 503 or 429 with
  `Retry-After` is retried after that wait, as a well-behaved client does;
- the core replaced: one restart, and requests started after the kill complete on the new core;
- no KV block leaked: at the end /metrics shows 0 running, 0 waiting, 0 KV cache usage;
- the server's RSS flat (within 10%) from the 200th request to the last;
- /health answers within 100 ms (p99), polled throughout.
It also times the restart under that load: `time_to_serving_s`, from the kill until a small
completion, sent again every 100 ms, is answered (and whether the spare core was ready then),
beside `probe_before_kill_s`, the same completion's latency just before the kill: under load
the probe waits behind the clients' requests, which all arrive again at the new core at once.
One JSON line at the end. A correctness check under load, not a speed benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

_WORDS = "the a river stone light city old new quiet story of and to in small bright far".split()


class Tally:
    """Outcomes by kind, and what the checks need while the run goes on."""

    def __init__(self) -> None:
        self.outcomes: dict[str, int] = {}
        self.lost: list[str] = []
        self.started = 0
        self.finished = 0
        self.retries = 0  # 503 / 429 answers with Retry-After, waited out
        self.completed_after_kill = 0
        self.rss_at: dict[int, int] = {}  # finished requests -> server RSS (kB)
        self.serving_again: asyncio.Task | None = None  # seconds from the kill to an answer
        self.probe_before_kill: float | None = None  # the same probe's latency just before

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self.finished += 1


_MAX_RETRY_WAIT_S = 300.0


async def _one_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> str:
    """The request's outcome; a 503 or 429 with Retry-After is sent again after that wait."""
    body = {
        "prompt": " ".join(rng.choices(_WORDS, k=rng.randint(4, 60))),
        "max_tokens": rng.randint(4, 48),
        "temperature": 0.8,
        "stream": True,
    }
    leave_after = rng.randint(1, 6) if rng.random() < 0.2 else None
    waited = 0.0
    try:
        while True:
            outcome, retry_after = await _attempt(client, body, leave_after)
            if retry_after is None or waited >= _MAX_RETRY_WAIT_S:
                return outcome
            tally.retries += 1
            waited += retry_after
            await asyncio.sleep(retry_after)
    except httpx.HTTPError as e:
        tally.lost.append(f"{type(e).__name__}: {e}")
        return "lost"


async def _attempt(
    client: httpx.AsyncClient, body: dict, leave_after: int | None
) -> tuple[str, float | None]:
    """(outcome, seconds to wait before trying again, or None: final)."""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code == 200:
            return await _read_stream(r, leave_after), None
        await r.aread()
        retry_after = r.headers.get("retry-after")
        if r.status_code in (429, 503) and retry_after is not None:
            return f"http_{r.status_code}", float(retry_after)
        return f"http_{r.status_code}", None


async def _read_stream(r: httpx.Response, leave_after: int | None) -> str:
    chunks, finish, error = 0, None, None
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            if error is not None:
                return "stream_error"
            return "completed" if finish is not None else "lost"
        data = json.loads(line[6:])
        if "error" in data:
            error = data["error"]
            continue
        chunks += 1
        finish = next((c["finish_reason"] for c in data["choices"] if c["finish_reason"]), finish)
        if leave_after is not None and chunks >= leave_after:
            return "left"  # closing the stream is the disconnect
    return "lost"  # the stream ended without [DONE]


async def _client(url: str, seed: int, tally: Tally, args: argparse.Namespace, pid: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        while tally.started < args.requests:
            tally.started += 1
            index = tally.started
            if index == args.kill_at and args.url is None:
                tally.probe_before_kill = await _probe(url)  # the same load, the old core
                _kill_core(pid)
                tally.serving_again = asyncio.create_task(_time_to_serving(url))
            outcome = await _one_request(client, rng, tally)
            tally.count(outcome)
            if outcome == "completed" and index > args.kill_at:
                tally.completed_after_kill += 1
            for mark in (200, args.requests):
                if tally.finished >= mark and mark not in tally.rss_at:
                    tally.rss_at[mark] = _rss_kb(pid)


async def _poll_health(url: str, latencies: list[float], stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                await client.get("/health")
            except httpx.HTTPError:
                pass
            latencies.append(time.perf_counter() - start)
            await asyncio.sleep(0.05)


def _kill_core(server_pid: int) -> None:
    """SIGKILL the serving core: the server's oldest child (a spare starts after it)."""
    pid = _children(server_pid)[0]
    print(f"soak: SIGKILL to the engine core {pid}", file=sys.stderr)
    os.kill(pid, signal.SIGKILL)


_PROBE = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}


async def _time_to_serving(url: str) -> float:
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        while (await client.post("/v1/completions", json=_PROBE)).status_code != 200:
            await asyncio.sleep(0.1)
    return time.monotonic() - start


async def _probe(url: str) -> float:
    """Seconds one probe takes to be answered (it waits behind the load's requests too)."""
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        (await client.post("/v1/completions", json=_PROBE)).raise_for_status()
    return time.monotonic() - start


def _children(pid: int) -> list[int]:
    """Live children, oldest first."""
    out = []
    for child in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{child}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == str(pid) and fields[0] != "Z":
            out.append((int(fields[19]), int(child)))  # (start time, pid)
    return [child for _, child in sorted(out)]


def _rss_kb(pid: int) -> int:
    if pid <= 0:
        return 0
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=60).text
    lines = re.finditer(r"^(pagellm:[a-z_]+)(?:\{[^}]*\})? (\S+)$", text, re.M)
    return {m.group(1): float(m.group(2)) for m in lines}


def _idle_metrics(url: str, timeout: float = 120) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        busy = m["pagellm:num_requests_running"] + m["pagellm:num_requests_waiting"]
        if (busy == 0 and m["pagellm:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def _start_server(args: argparse.Namespace, log_path: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pagellm", "serve", "--port", str(port), "--restart-engine"]
    cmd += ["--max-model-len", "512", *args.server_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not start; see {log_path}")


async def _run(args: argparse.Namespace, url: str, pid: int) -> tuple[Tally, list[float]]:
    tally, latencies, stop = Tally(), [], asyncio.Event()
    poller = asyncio.create_task(_poll_health(url, latencies, stop))
    await asyncio.gather(*(_client(url, i, tally, args, pid) for i in range(args.clients)))
    if tally.serving_again is not None:
        await tally.serving_again
    stop.set()
    await poller
    return tally, latencies


def _summary(tally: Tally, latencies: list[float], m: dict, seconds: float) -> dict:
    latencies = sorted(latencies)
    p99 = latencies[int(0.99 * (len(latencies) - 1))] if latencies else None
    rss = [tally.rss_at.get(k) for k in sorted(tally.rss_at)]
    growth = (rss[-1] - rss[0]) / rss[0] if len(rss) == 2 and rss[0] else None
    return {
        "requests": tally.finished,
        "outcomes": tally.outcomes,
        "retries": tally.retries,
        "completed_after_kill": tally.completed_after_kill,
        "lost_without_error": tally.outcomes.get("lost", 0),
        "lost_examples": tally.lost[:3],
        "running_at_end": m.get("pagellm:num_requests_running"),
        "waiting_at_end": m.get("pagellm:num_requests_waiting"),
        "kv_usage_at_end": m.get("pagellm:kv_cache_usage_perc"),
        "engine_restarts": m.get("pagellm:engine_restarts_total"),
        "time_to_serving_s": (
            round(tally.serving_again.result(), 2) if tally.serving_again is not None else None
        ),
        "probe_before_kill_s": (
            None if tally.probe_before_kill is None else round(tally.probe_before_kill, 2)
        ),
        "rss_kb_at_200_and_end": rss,
        "rss_growth": None if growth is None else round(growth, 4),
        "health_p99_ms": None if p99 is None else round(p99 * 1000, 1),
        "health_max_ms": round(latencies[-1] * 1000, 1) if latencies else None,
        "seconds": round(seconds, 1),
    }


def _spare_ready_at_kill(log_path: str) -> bool:
    """Whether the server's log says a spare core was ready before the core died."""
    with open(log_path, errors="replace") as f:
        before_death = f.read().split("the engine core died", 1)[0]
    return bool(re.search(r"spare engine core \d+ ready", before_death))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running server (its core is not killed)")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--kill-at", type=int, default=500, help="kill the core at this request")
    p.add_argument("server_args", nargs="*", help="more `pagellm serve` flags (after --)")
    args = p.parse_args()
    proc, url = None, args.url
    log_path = os.path.join(tempfile.mkdtemp(prefix="pagellm-soak-"), "server.log")
    if url is None:
        proc, url = _start_server(args, log_path)
    start = time.perf_counter()
    try:
        tally, latencies = asyncio.run(_run(args, url, proc.pid if proc else -1))
        summary = _summary(tally, latencies, _idle_metrics(url), time.perf_counter() - start)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    summary["server_log"] = log_path if proc is not None else None
    summary["spare_ready_at_kill"] = _spare_ready_at_kill(log_path) if proc is not None else None
    ok = summary["lost_without_error"] == 0 and summary["kv_usage_at_end"] == 0
    ok = ok and summary["running_at_end"] == 0 and (summary["rss_growth"] or 0) <= 0.10
    if proc is not None and args.kill_at <= args.requests:  # the core was killed: replaced?
        ok = ok and summary["engine_restarts"] == 1 and summary["completed_after_kill"] > 0
    summary["ok"] = ok and (summary["health_p99_ms"] or 0) < 100
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
