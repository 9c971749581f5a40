"""MultiprocExecutor: one worker process per tensor-parallel rank on this machine.

The EngineCore process starts `python -m pagellm.worker.worker_proc` once per rank (nothing
of the caller's `__main__` is re-imported) and hands each its rank and the config on stdin.
The ranks meet at a TCPStore this process hosts on the loopback and form a process group
(NCCL on GPUs, gloo on the CPU). Two ZMQ `ipc://` sockets in a private directory carry the
rest: one PUB socket sends every step and call to all ranks at once, one PULL socket gets the
answers (rank 0's step outputs, every rank's call results).

A worker exits when the EngineCore process does (it watches its parent, even after SIGKILL)
and removes the socket directory. If a worker dies, a waiting `execute_model` raises within
_POLL_MS, and an idle EngineCore hears of it through the failure callback.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from typing import Any

import msgspec
import zmq

from pagellm.config import EngineConfig
from pagellm.executor.abstract import DistributedExecutor
from pagellm.utils import wait_or_kill

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often a waiting executor checks that its workers are alive
_SHUTDOWN_S = 3.0  # how long workers get to exit before they are killed
_ERRORS = {"ValueError": ValueError, "NotImplementedError": NotImplementedError}


class MultiprocExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig) -> None:
        import torch.distributed as dist

        super().__init__(config)
        self.world_size = config.parallel_config.tensor_parallel_size
        self.ipc_dir = tempfile.mkdtemp(prefix="pagellm-workers-")  # mode 0700
        self.ctx = zmq.Context()
        self.broadcast = self.ctx.socket(zmq.XPUB)  # a PUB that reports its subscribers
        self.broadcast.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.broadcast.setsockopt(zmq.SNDHWM, 0)  # never drop a message
        self.broadcast.bind(f"ipc://{self.ipc_dir}/broadcast")
        self.answers = self.ctx.socket(zmq.PULL)
        self.answers.bind(f"ipc://{self.ipc_dir}/answers")
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        self.procs: list[subprocess.Popen] = []
        self._closing = threading.Event()
        self._finalizer = weakref.finalize(
            self, _cleanup, self.procs, self._closing, self.ctx, self.ipc_dir
        )
        self.pending: collections.deque[list[bytes]] = collections.deque()  # unread answers
        self.call_ids = itertools.count()
        try:
            self._start_workers(config)
            self._wait_for_workers()
        except BaseException:
            self.shutdown()
            raise
        for rank, proc in enumerate(self.procs):
            threading.Thread(
                target=self._monitor, args=(rank, proc), daemon=True, name=f"watch-rank{rank}"
            ).start()

    # ---- start-up ----------------------------------------------------------------------

    def _start_workers(self, config: EngineConfig) -> None:
        wire = config.to_wire()
        paths = (f"ipc://{self.ipc_dir}/broadcast", f"ipc://{self.ipc_dir}/answers")
        for rank in range(self.world_size):
            proc = subprocess.Popen(
                [sys.executable, "-m", "pagellm.worker.worker_proc"],
                stdin=subprocess.PIPE,
                env=os.environ,
            )
            self.procs.append(proc)
            message = (wire, rank, rank, "127.0.0.1", self.store.port, *paths, self.ipc_dir)
            proc.stdin.write(msgspec.msgpack.encode(message))
            proc.stdin.close()

    def _wait_for_workers(self) -> None:
        """Until every rank is subscribed to the broadcast and has built its model."""
        subscribed, ready = 0, 0
        poller = zmq.Poller()
        poller.register(self.broadcast, zmq.POLLIN)
        poller.register(self.answers, zmq.POLLIN)
        while subscribed < self.world_size or ready < self.world_size:
            events = dict(poller.poll(_POLL_MS))
            if self.broadcast in events and self.broadcast.recv()[:1] == b"\x01":
                subscribed += 1
            if self.answers in events:
                ready += self._check(self.answers.recv_multipart())[0] == b"ready"
            self._check_workers()
        logger.info("%d tensor-parallel workers ready", self.world_size)

    # ---- sending and answers -------------------------------------------------------------

    def _send(self, method: str, payload: bytes) -> _Answer:
        self._check_workers()
        self.broadcast.send_multipart((method.encode(), payload), copy=False)
        return _Answer(self)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        call_id = next(self.call_ids)
        self._send("rpc", msgspec.msgpack.encode((call_id, method, list(args))))
        results: dict[int, Any] = {}
        while len(results) < self.world_size:
            _, rank, payload = self.recv(b"rpc")
            got_id, ok, result = msgspec.msgpack.decode(payload)
            if got_id != call_id:
                continue  # an answer to a call whose caller gave up (raised)
            if not ok:
                raise RuntimeError(f"{method} failed on tensor-parallel rank {int(rank)}: {result}")
            results[int(rank)] = result
        return [results[r] for r in range(self.world_size)]

    def recv(self, kind: bytes) -> list[bytes]:
        """The next answer of `kind` (b"output" or b"rpc"), keeping others for later."""
        for i, frames in enumerate(self.pending):
            if frames[0] == kind:
                del self.pending[i]
                return frames
        while True:
            while not self.answers.poll(_POLL_MS):
                self._check_workers()
            frames = self._check(self.answers.recv_multipart())
            if frames[0] == kind:
                return frames
            self.pending.append(frames)

    def _check(self, frames: list[bytes]) -> list[bytes]:
        if frames[0] == b"failed":
            rank, (type_name, message) = int(frames[1]), msgspec.msgpack.decode(frames[2])
            error = _ERRORS.get(type_name, RuntimeError)
            raise error(f"tensor-parallel rank {rank} failed: {type_name}: {message}")
        return frames

    # ---- faults and shutdown ---------------------------------------------------------------

    def _check_workers(self) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise RuntimeError(_died(rank, proc))

    def _monitor(self, rank: int, proc: subprocess.Popen) -> None:
        proc.wait()
        if not self._closing.is_set():
            self._closing.set()  # one report is enough
            logger.error(_died(rank, proc))
            if self.failure_callback is not None:
                self.failure_callback(_died(rank, proc))

    def shutdown(self) -> None:
        self._finalizer()


class _Answer:
    """Rank 0's next step output on the PULL socket (answers come in the order sent)."""

    __slots__ = ("executor",)

    def __init__(self, executor: MultiprocExecutor) -> None:
        self.executor = executor

    def get(self) -> bytes:
        return self.executor.recv(b"output")[2]


def _died(rank: int, proc: subprocess.Popen) -> str:
    return f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {proc.returncode}"


def _cleanup(procs: list, closing: threading.Event, ctx: zmq.Context, ipc_dir: str) -> None:
    """Stop the workers, close the sockets, remove the socket files. SIGTERM ends a worker at
    once (it has no handler: a rank stuck in a collective cannot run one), a worker that
    still lives after _SHUTDOWN_S is killed. Runs once: from shutdown(), when the executor
    is garbage-collected, or at interpreter exit."""
    closing.set()  # these deaths are no fault
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        wait_or_kill(proc, _SHUTDOWN_S)
    ctx.destroy(linger=0)
    shutil.rmtree(ipc_dir, ignore_errors=True)
