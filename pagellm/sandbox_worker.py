"""A sandbox worker process, `python -m pagellm.sandbox_worker LANE_SPEC_JSON`: it runs
module-level functions named by import path for its parent (`pagellm/sandbox.py`), one call at
a time, under the lane's memory limit and CPU priority (both set by itself as it starts). The
parent enforces the time limit by killing it; it dies with its parent.

Frames on stdin and stdout: a 4-byte big-endian length, then msgpack (`Call` in, `Reply` out).
The process's own stdout goes to stderr, so a print() cannot corrupt them. This module imports
msgspec and the standard library only: a worker starts in ~0.1 s and ~15 MB before its
initializer.
"""

from __future__ import annotations

import importlib
import os
import signal
import struct
import sys
from typing import Any, BinaryIO

import msgspec

_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = (1 << 32) - 1
MAX_MESSAGE_CHARS = 1000  # of an error message sent back


class LaneSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """A lane of sandbox workers: how many, how much work may wait for them, and each call's
    limits. `initializer` ("package.module:function") runs once in each new worker with
    `initializer_args` (plain data), before its memory limit is set (so it may build tables the
    calls share)."""

    name: str
    workers: int = 1
    max_queued: int = 64  # calls waiting for a worker; more are refused (`SandboxBusy`)
    timeout_s: float = 5.0  # a call's wall time; past it the worker is killed
    memory_limit_mb: int = 256  # RLIMIT_DATA above the worker's size after its initializer; 0: none
    nice: int = 0  # added to the worker's niceness: 19 runs it only on otherwise idle CPUs
    initializer: str | None = None
    initializer_args: tuple = ()

    def __post_init__(self) -> None:
        if self.workers < 1 or self.max_queued < 0 or self.memory_limit_mb < 0:
            raise ValueError(f"lane {self.name}: workers >= 1, max_queued and memory >= 0")
        if not self.timeout_s > 0 or not 0 <= self.nice <= 19:
            raise ValueError(f"lane {self.name}: timeout_s > 0 and nice in [0, 19]")


class Call(msgspec.Struct, array_like=True, omit_defaults=True):
    function: str  # "package.module:function"
    args: list = []
    kwargs: dict = {}


class Reply(msgspec.Struct, array_like=True, omit_defaults=True):
    value: Any = None
    error: str = ""  # "": ok; "value": a ValueError, its message for the user; "limit"; "failed"
    limit: str = ""  # with "limit": "memory", or the function's own (`LimitExceeded.limit`)
    message: str = ""  # "value" and "limit": the function's words; "failed": the type's name


class LimitExceeded(Exception):
    """Raised by a function run in a lane when its input takes it past one of its own limits
    (the parent reports which: `limit`)."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


def resolve(path: str) -> Any:
    """ "package.module:function" -> the function."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def write_frame(out: BinaryIO, data: bytes) -> None:
    out.write(_HEADER.pack(len(data)) + data)
    out.flush()


def read_frame(inp: BinaryIO) -> bytes | None:
    header = inp.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None  # the parent closed the pipe
    (size,) = _HEADER.unpack(header)
    data = inp.read(size)
    return data if len(data) == size else None


def run(data: bytes) -> Reply:
    try:
        call = msgspec.msgpack.decode(data, type=Call)
        return Reply(value=resolve(call.function)(*call.args, **call.kwargs))
    except MemoryError:
        return Reply(error="limit", limit="memory", message="the memory limit")
    except LimitExceeded as e:
        return Reply(error="limit", limit=e.limit, message=_shortened(str(e)))
    except ValueError as e:
        return Reply(error="value", message=_shortened(str(e)))
    except Exception as e:
        return Reply(error="failed", message=type(e).__name__)


def _shortened(message: str) -> str:
    """At most MAX_MESSAGE_CHARS: a message may quote its input (a template's own words)."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 3] + "..."


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the parent dies (Linux), even while a call runs."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before prctl
        os._exit(0)


def _limit_memory(megabytes: int) -> None:
    """RLIMIT_DATA (private writable memory: the heap, Python's arenas) at the current size plus
    `megabytes`: an allocation past it is a MemoryError. Linux only (elsewhere: no limit)."""
    if megabytes <= 0:
        return
    try:
        import resource

        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        used = int(fields["VmData"].split()[0]) * 1024
        limit = used + (megabytes << 20)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    except (OSError, ImportError, KeyError, ValueError):
        pass


def main() -> None:
    parent = os.getppid()
    spec = msgspec.json.decode(sys.argv[1], type=LaneSpec)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's to handle
    _die_with_parent(parent)
    os.nice(spec.nice)
    if spec.initializer:
        resolve(spec.initializer)(*spec.initializer_args)
    _limit_memory(spec.memory_limit_mb)
    encoder = msgspec.msgpack.Encoder()
    write_frame(out, encoder.encode(Reply(value="ready")))
    inp = sys.stdin.buffer
    while (data := read_frame(inp)) is not None:
        reply = run(data)
        try:
            write_frame(out, encoder.encode(reply))
        except (TypeError, msgspec.EncodeError):  # a result msgpack cannot carry
            write_frame(out, encoder.encode(Reply(error="failed", message="its result")))
        if reply.limit == "memory":
            break  # its heap may be fragmented past use: the parent starts another


if __name__ == "__main__":  # run as this module, not as __main__: one LimitExceeded class
    from pagellm.sandbox_worker import main as module_main

    module_main()
