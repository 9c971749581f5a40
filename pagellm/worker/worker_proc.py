"""A tensor-parallel worker process: one rank, driven by a MultiprocExecutor.

Started as `python -m pagellm.worker.worker_proc` by the EngineCore process; its rank, the
config (`EngineConfig.to_wire()`), the TCPStore address and the socket paths arrive on stdin
as msgpack. It builds its `Worker` (process group, model shard), says "ready", then runs
what the broadcast socket brings, in order (`Worker.handle`), and sends back its answers:
"output" for a step (rank 0), "rpc" for a call (every rank).

An exception ends the process after a "failed" answer: the ranks would no longer agree.
It exits when its parent does, and keeps no signal handler: SIGTERM ends it at once, even
inside a collective.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
import time
import traceback

import msgspec
import zmq

from pagellm import envs
from pagellm.config import EngineConfig
from pagellm.worker.worker import Worker

logger = logging.getLogger("pagellm.worker.worker_proc")

_POLL_S = 0.5  # how often a worker checks that its parent is alive


def serve(worker: Worker, sub: zmq.Socket, push: zmq.Socket, rank: bytes) -> None:
    while True:
        method, payload = sub.recv_multipart()
        answer = worker.handle(method.decode(), payload)
        if answer is not None:
            push.send_multipart((b"rpc" if method == b"rpc" else b"output", rank, answer))


def _watch_parent(parent_pid: int, ipc_dir: str) -> None:
    """Exit when the EngineCore process is gone (even after SIGKILL), removing its sockets."""
    while os.getppid() == parent_pid:
        time.sleep(_POLL_S)
    shutil.rmtree(ipc_dir, ignore_errors=True)
    os._exit(0)


def run_worker(message: bytes) -> int:
    wire, rank, local_rank, host, port, broadcast_path, answer_path, ipc_dir = (
        msgspec.msgpack.decode(message)
    )
    logging.basicConfig(
        level=envs.log_level(), format=f"%(levelname)s %(asctime)s rank{rank} %(name)s: %(message)s"
    )
    threading.Thread(target=_watch_parent, args=(os.getppid(), ipc_dir), daemon=True).start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(broadcast_path)
    push = ctx.socket(zmq.PUSH)
    push.connect(answer_path)
    rank_frame = str(rank).encode()
    try:
        config = EngineConfig.from_wire(wire)
        worker = Worker(config, rank, local_rank, (host, port))
        push.send_multipart((b"ready", rank_frame, b""))
        serve(worker, sub, push, rank_frame)
    except BaseException as e:
        logger.error("worker rank %d failed:\n%s", rank, traceback.format_exc())
        failure = msgspec.msgpack.encode([type(e).__name__, str(e)])
        push.send_multipart((b"failed", rank_frame, failure))
        push.close(linger=2000)
        return 1
    return 0


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle
    message = sys.stdin.buffer.read()
    if not message:
        return  # the executor gave up before sending it
    code = run_worker(message)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no waiting on ZMQ's or the process group's teardown


if __name__ == "__main__":
    main()
