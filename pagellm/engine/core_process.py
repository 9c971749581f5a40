"""The EngineCore child process as its parent (`MPClient`) ends it: politely (its stdin
closed, a SHUTDOWN message), then not (terminate, kill), its sockets closed and its IPC files
removed; and the error of a child that failed to start, in its own type for the common ones.
A core that dies of an error leaves its reason in the IPC directory too (DEATH_REPORT).
"""

from __future__ import annotations

import shutil
import subprocess

import zmq

from pagellm.protocol import EngineCoreRequestType
from pagellm.utils import wait_or_kill

_SHUTDOWN_S = 5.0  # how long the core process gets to exit before it is killed
DEATH_REPORT = "failed"  # in the IPC directory: the core's FAILED payload, written before it exits


def cleanup(proc: subprocess.Popen, in_sock, out_sock, ipc_dir: str) -> None:
    """Stop the core process (politely, then not), close sockets, remove the IPC files.

    Runs once: from shutdown(), when the client is garbage-collected, or at interpreter exit.
    """
    if proc.stdin is not None and not proc.stdin.closed:
        try:
            proc.stdin.close()  # a core still waiting for its config reads EOF and exits
        except BrokenPipeError:
            pass
    if proc.poll() is None:
        try:
            in_sock.send_multipart((EngineCoreRequestType.SHUTDOWN.value, b"\xc0"), zmq.NOBLOCK)
        except zmq.ZMQError:
            proc.terminate()
    wait_or_kill(proc, _SHUTDOWN_S)
    in_sock.close(linger=0)
    out_sock.close(linger=0)
    shutil.rmtree(ipc_dir, ignore_errors=True)


_STARTUP_ERRORS = {
    "ValueError": ValueError,
    "FileNotFoundError": FileNotFoundError,
    "TypeError": TypeError,
    "NotImplementedError": NotImplementedError,
}


def startup_error(failure: list[str]) -> Exception:
    """The child's own exception type (for the common ones) and message."""
    type_name, message = failure
    return _STARTUP_ERRORS.get(type_name, RuntimeError)(f"EngineCore failed to start: {message}")
