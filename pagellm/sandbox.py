"""Sandboxes for work whose cost a request controls (rendering a chat template): module-level
functions run in worker processes that can be abandoned, in lanes with their own limits.

A `Lane` keeps `workers` processes (`python -m pagellm.sandbox_worker`) started from its
`LaneSpec`; calls wait for a free one in a queue of at most `max_queued`. A call past the lane's
wall time, or one whose caller is cancelled (a client that left), has its worker killed
(SIGKILL: its CPU and memory are freed at once) and a new one started in the background; a
worker that hits its memory limit answers so and is replaced too. Nothing here blocks the
event loop: workers are asyncio subprocesses talking over pipes. Lanes keep kinds of work
apart, so that one kind never queues in front of another: the server renders its own chat
template and templates sent in requests in two (`entrypoints/openai/chat_templates.py`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import sys
import time
from collections.abc import Iterable
from typing import Any

import msgspec

import pagellm
from pagellm.sandbox_worker import MAX_FRAME_BYTES, Call, LaneSpec, Reply

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0  # a worker's start, initializer included
_RESPAWN_DELAY_S = 1.0  # after a worker failed to start
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(pagellm.__file__)))


class SandboxError(RuntimeError):
    """A sandboxed call that did not answer (its worker died, or the lane is closed)."""


class SandboxBusy(SandboxError):
    """The lane's queue is full."""


class SandboxLimitError(SandboxError):
    """A call past a limit: "time" (the lane's `timeout_s`), "memory" (`memory_limit_mb`) or
    one of the function's own (`LimitExceeded`)."""

    def __init__(self, limit: str, spec: LaneSpec, message: str = "") -> None:
        super().__init__(message or f"lane {spec.name}: past its {limit} limit")
        self.limit = limit
        self.spec = spec


class _Worker:
    __slots__ = ("proc",)

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, spec: LaneSpec) -> _Worker:
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, path]))}
        # no preexec_fn (the worker sets its own niceness): with one, Popen would fork() the
        # whole API server, on the event loop, instead of vfork()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pagellm.sandbox_worker", msgspec.json.encode(spec).decode(),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        worker = cls(proc)
        try:
            ready = await asyncio.wait_for(worker.read(), _START_TIMEOUT_S)
        except BaseException:
            worker.kill()
            raise
        if ready is None:
            worker.kill()
            raise SandboxError(f"a worker of lane {spec.name} exited while starting")
        return worker

    async def call(self, frame: bytes) -> Reply | None:
        """The reply to one call; None if the worker died first."""
        self.proc.stdin.write(frame)
        await self.proc.stdin.drain()
        return await self.read()

    async def read(self) -> Reply | None:
        try:
            size = int.from_bytes(await self.proc.stdout.readexactly(4), "big")
            return msgspec.msgpack.decode(await self.proc.stdout.readexactly(size), type=Reply)
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError):
            return None

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


class Lane:
    """Workers for one `LaneSpec`, and the calls that wait for them."""

    def __init__(self, spec: LaneSpec) -> None:
        self.spec = spec
        self.idle: list[_Worker] = []
        self.waiting: collections.deque[asyncio.Future] = collections.deque()
        self.workers: set[_Worker] = set()  # started: idle or busy
        self.tasks: set[asyncio.Task] = set()  # starting replacements
        self.closed = False

    async def start(self) -> None:
        """Starts the lane's workers; raises if one cannot start."""
        starts = (_Worker.start(self.spec) for _ in range(self.spec.workers))
        workers = await asyncio.gather(*starts)
        for worker in workers:
            self.workers.add(worker)
            self._release(worker)

    async def call(self, function: str, *args: Any, **kwargs: Any) -> Any:
        """`function(*args, **kwargs)` ("package.module:function", plain data in and out) in a
        worker. A ValueError of the function is raised here with its message; a limit is a
        `SandboxLimitError`, a full queue `SandboxBusy`."""
        frame = _frame(Call(function, list(args), kwargs))
        worker = await self._acquire()
        try:
            reply = await asyncio.wait_for(worker.call(frame), self.spec.timeout_s)
        except asyncio.TimeoutError:
            self._retire(worker)
            raise SandboxLimitError("time", self.spec) from None
        except BaseException:  # cancelled: its caller left; the worker is mid-call
            self._retire(worker)
            raise
        if reply is None or reply.limit == "memory":
            self._retire(worker)
        else:
            self._release(worker)
        return self._result(function, reply)

    def _result(self, function: str, reply: Reply | None) -> Any:
        if reply is None:
            raise SandboxError(f"lane {self.spec.name}: the worker running {function} died")
        if reply.error == "value":
            raise ValueError(reply.message)
        if reply.error == "limit":
            raise SandboxLimitError(reply.limit, self.spec, reply.message)
        if reply.error:
            raise SandboxError(f"{function} failed in lane {self.spec.name}: {reply.message}")
        return reply.value

    async def _acquire(self) -> _Worker:
        if self.closed:
            raise SandboxError(f"lane {self.spec.name} is closed")
        if self.idle:
            return self.idle.pop()
        if len(self.waiting) >= self.spec.max_queued:
            raise SandboxBusy(f"lane {self.spec.name}: {len(self.waiting)} calls already wait")
        waiter = asyncio.get_running_loop().create_future()
        self.waiting.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release(waiter.result())  # handed over as its caller left
            elif waiter in self.waiting:  # (else `_release` dropped it already)
                self.waiting.remove(waiter)
            raise

    def _release(self, worker: _Worker) -> None:
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_result(worker)
                return
        self.idle.append(worker)

    def _retire(self, worker: _Worker) -> None:
        """Kills a worker (its memory is freed at once) and starts another in its place."""
        worker.kill()
        self.workers.discard(worker)
        if not self.closed:
            self._spawn(self._replace())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _replace(self) -> None:
        while not self.closed:
            started = time.monotonic()
            try:
                worker = await _Worker.start(self.spec)
            except Exception as e:
                logger.error("sandbox lane %s: a worker failed to start: %s", self.spec.name, e)
                await asyncio.sleep(_RESPAWN_DELAY_S)
                continue
            if self.closed:
                worker.kill()
                return
            logger.debug("sandbox lane %s: a new worker in %.3f s", self.spec.name,
                         time.monotonic() - started)  # fmt: skip
            self.workers.add(worker)
            self._release(worker)
            return

    async def close(self) -> None:
        self.closed = True
        for waiter in self.waiting:
            waiter.cancel()
        for task in list(self.tasks):
            task.cancel()
        workers = list(self.workers)
        for worker in workers:
            worker.kill()
        await asyncio.gather(*(w.proc.wait() for w in workers), return_exceptions=True)


class Sandbox:
    """Lanes by name; started and closed together."""

    def __init__(self, specs: Iterable[LaneSpec]) -> None:
        self.lanes = {spec.name: Lane(spec) for spec in specs}

    async def start(self) -> None:
        await asyncio.gather(*(lane.start() for lane in self.lanes.values()))

    async def call(self, lane: str, function: str, *args: Any, **kwargs: Any) -> Any:
        return await self.lanes[lane].call(function, *args, **kwargs)

    async def close(self) -> None:
        await asyncio.gather(*(lane.close() for lane in self.lanes.values()))


def _frame(call: Call) -> bytes:
    try:
        data = msgspec.msgpack.encode(call)
    except (TypeError, OverflowError, RecursionError, msgspec.EncodeError):
        raise ValueError(
            "the request holds a value the server cannot pass on (an integer beyond 64 bits, "
            "or data nested too deep)"
        ) from None
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError("the request is too large to pass on")
    return len(data).to_bytes(4, "big") + data
