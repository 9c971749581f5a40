"""EngineCoreClient: how the caller side talks to an EngineCore.

- `InprocClient`: EngineCore in this process, `get_output()` runs one step
  (PAGELLM_ENABLE_MULTIPROCESSING=0; same code, easy to debug).
- `SyncMPClient` (LLM, LLMEngine) and `AsyncMPClient` (AsyncLLM): EngineCore in a child
  process that steps on its own; requests go in and outputs come back over ZMQ `ipc://`
  sockets in a private temporary directory, as msgpack-encoded msgspec structs.

If the child dies, every waiting call raises EngineDeadError within a poll (_POLL_MS; the
asyncio client, a server's, polls more often: a restart waits on it) and, when the child
exited itself, the time its death report may take to arrive (_REPORT_S); a core that dies of
an error also leaves the report in the directory before it exits (`DEATH_REPORT`), read at
once.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import subprocess
import sys
import tempfile
import time
import weakref
from abc import ABC, abstractmethod
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pagellm import envs
from pagellm.config import EngineConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core_process import DEATH_REPORT, cleanup, startup_error
from pagellm.protocol import (
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestType,
)

_POLL_MS = 200  # how often a waiting client checks that the core process is alive
_ASYNC_POLL_MS = 50  # the same for AsyncMPClient: waiting there costs no thread
_IN_FLIGHT_MS = 50  # after the core exited: how long its last frames may take to arrive
_REPORT_S = 0.2  # after it exited itself: how long its death report may take to arrive
_EXIT_GRACE_S = 0.5  # and how long unread frames may hold off the verdict
# how the core process is started, after the interpreter (tests run it under a fault injector)
CORE_PROCESS_ARGS = ["-m", "pagellm.engine.core_proc"]


class EngineDeadError(RuntimeError):
    """The EngineCore process is gone; no request can make progress."""


def start_engine(engine_args: EngineArgs, asyncio_mode: bool = False) -> tuple:
    """(EngineConfig, tokenizer, client) for LLMEngine / AsyncLLM.

    With multiprocessing the core process starts first: its imports (torch, the kernels)
    overlap the caller's config resolution (transformers), whose result it then receives.
    """
    from pagellm import loader

    if not envs.enable_multiprocessing():
        config = engine_args.create_engine_config()
        tokenizer = loader.load_tokenizer(config.model_config.source)
        inproc = InprocClient(config)
        return inproc.engine_core.config, tokenizer, inproc  # max_model_len "auto" resolved
    client = (AsyncMPClient if asyncio_mode else SyncMPClient)()
    try:
        config = engine_args.create_engine_config()
        client.start_core(config)
        tokenizer = loader.load_tokenizer(config.model_config.source)
        ready = client.wait_for_ready()
    except BaseException:
        client.shutdown()
        raise
    # max_model_len="auto" resolves in the core, once its KV cache is sized
    return config.with_max_model_len(ready.max_model_len), tokenizer, client


class EngineCoreClient(ABC):
    """add_request / abort_requests go in; get_output() returns what the core produced."""

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next outputs of the engine (may be empty when nothing is running)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any:
        """Run a named EngineCore utility (e.g. get_num_free_blocks) and return its result."""

    @abstractmethod
    def shutdown(self) -> None: ...

    def is_alive(self) -> bool:
        """Whether the core can still run requests (a core in this process always can)."""
        return True


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        from pagellm.engine.core import EngineCore

        self.engine_core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.engine_core.call_utility(method, list(args))

    def shutdown(self) -> None:
        self.engine_core.shutdown()

    # AsyncLLM's interface: steps run in the event loop (this mode is for debugging)
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return self.call_utility(method, *args)

    async def get_output_async(self) -> EngineCoreOutputs:
        while not self.engine_core.has_unfinished_requests():
            await asyncio.sleep(0.005)
        outputs = self.engine_core.step()
        await asyncio.sleep(0)
        return outputs


class MPClient(EngineCoreClient):
    """Starts the core process, waits for READY, owns the sockets and the clean-up."""

    def __init__(self, ctx: zmq.Context, env: dict[str, str] | None = None) -> None:
        """`env`: environment variables the core process gets beside this one's."""
        self.ipc_dir = tempfile.mkdtemp(prefix="pagellm-")  # mode 0700
        self.paths = tuple(f"ipc://{self.ipc_dir}/{n}" for n in ("input", "output"))
        input_path, output_path = self.paths
        self.ctx = ctx
        self.input_socket = zmq.Context.instance().socket(zmq.PUSH)
        self.input_socket.bind(input_path)
        self.output_socket = ctx.socket(zmq.PULL)
        self.output_socket.bind(output_path)
        self.proc = subprocess.Popen(  # imports, then waits for start_core()
            [sys.executable, *CORE_PROCESS_ARGS, self.ipc_dir],
            stdin=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        self._finalizer = weakref.finalize(
            self, cleanup, self.proc, self.input_socket, self.output_socket, self.ipc_dir
        )
        self.dead_error: EngineDeadError | None = None
        self._exit_seen: float | None = None  # when the process was first seen gone (_check_alive)
        self.decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.encoder = msgspec.msgpack.Encoder()
        self.call_ids = itertools.count()
        self.ready: EngineCoreReady | None = None

    def start_core(self, config: EngineConfig) -> None:
        """Hand the core process its config (and the socket paths): it builds the engine."""
        message = (config.to_wire(), *self.paths)
        try:
            self.proc.stdin.write(msgspec.msgpack.encode(message))
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # the process died while importing: wait_for_ready() reports it

    def wait_for_ready(self) -> EngineCoreReady:
        """Blocks until the core reports READY; raises the core's own start-up error."""
        sock = zmq.Socket.shadow(self.output_socket.underlying)  # a blocking view
        while not sock.poll(_POLL_MS):
            if self.proc.poll() is not None and not sock.poll(_POLL_MS):
                raise self._exited_during_startup()
        return self._read_ready(sock.recv_multipart())

    def _read_ready(self, frames: list[bytes]) -> EngineCoreReady:
        kind, payload = frames
        if kind == EngineCoreOutputType.FAILED.value:
            self.shutdown()
            raise startup_error(msgspec.msgpack.decode(payload))
        self.ready = msgspec.msgpack.decode(payload, type=EngineCoreReady)
        return self.ready

    def _exited_during_startup(self) -> RuntimeError:
        self.shutdown()
        return RuntimeError(
            f"EngineCore process exited with code {self.proc.returncode} during start-up"
        )

    def _send(self, kind: EngineCoreRequestType, message: Any) -> None:
        # a PUSH socket whose peer is gone would block forever: wait for room, checking
        # that the core is alive, and never block in send itself
        frames = (kind.value, self.encoder.encode(message))
        while not self._try_send(frames):
            self.input_socket.poll(_POLL_MS, zmq.POLLOUT)

    async def _send_async(self, kind: EngineCoreRequestType, message: Any) -> None:
        """`_send` that waits for room in the socket without holding the event loop."""
        frames = (kind.value, self.encoder.encode(message))
        while not self._try_send(frames):
            await asyncio.sleep(0.005)

    def _try_send(self, frames: tuple) -> bool:
        self._check_alive()
        try:
            self.input_socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:  # the queue to the core is full
            return False
        return True

    def _decode(self, frames: list[bytes]) -> EngineCoreOutputs:
        kind, payload = frames
        if kind == EngineCoreOutputType.FAILED.value:
            self._mark_dead(f"EngineCore died: {msgspec.msgpack.decode(payload)[1]}")
        return self.decoder.decode(payload)

    def is_alive(self) -> bool:
        return self.dead_error is None and self.proc.poll() is None

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self.proc.poll() is None:
            return
        reason = self._death_report()
        if reason is not None:
            self._mark_dead(f"EngineCore died: {reason}")
        # A core that dies of an error reports it just before it exits, and the report may
        # still be on its way to the output socket: a core that exited itself (a code >= 0;
        # not one killed by a signal, which sends nothing) gives the reader _REPORT_S from
        # the first sighting of the exit to read it ("EngineCore died: <reason>"); while
        # frames wait in the socket (the sender's and the reader's checks may come in a
        # row), the reader has them to read first, for at most _EXIT_GRACE_S.
        now = time.monotonic()
        if self._exit_seen is None:
            self._exit_seen = now
        waited = now - self._exit_seen
        if self.proc.returncode >= 0 and waited < _REPORT_S:
            return
        if waited < _EXIT_GRACE_S and self._output_pending():
            return
        self._mark_dead(f"EngineCore process exited unexpectedly (code {self.proc.returncode})")

    def _death_report(self) -> str | None:
        """The reason an exited core left in the IPC directory (`core_proc.write_death_report`,
        written before it exited): the socket's report may still be on its way."""
        try:
            with open(os.path.join(self.ipc_dir, DEATH_REPORT), "rb") as f:
                return str(msgspec.msgpack.decode(f.read())[1])
        except (OSError, msgspec.DecodeError, IndexError, TypeError, KeyError):
            return None

    def _output_pending(self) -> bool:
        """Frames from the core not read yet (through a blocking view of the socket: the same
        check for the asyncio client), waiting a little for ones still in flight."""
        return bool(zmq.Socket.shadow(self.output_socket.underlying).poll(_IN_FLIGHT_MS))

    def _mark_dead(self, message: str) -> None:
        self.dead_error = EngineDeadError(message)
        raise self.dead_error

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(EngineCoreRequestType.ABORT, request_ids)

    def shutdown(self) -> None:
        self._finalizer()


class SyncMPClient(MPClient):
    def __init__(self, env: dict[str, str] | None = None) -> None:
        super().__init__(zmq.Context.instance(), env)
        self.pending: collections.deque[EngineCoreOutputs] = collections.deque()

    def _recv(self) -> EngineCoreOutputs:
        while not self.output_socket.poll(_POLL_MS):
            self._check_alive()
        return self._decode(self.output_socket.recv_multipart())

    def get_output(self) -> EngineCoreOutputs:
        if self.pending:
            return self.pending.popleft()
        return self._recv()

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id = next(self.call_ids)
        self._send(EngineCoreRequestType.UTILITY, (call_id, method, list(args)))
        while True:
            outputs = self._recv()
            reply = outputs.utility_output
            if reply is not None and reply.call_id == call_id:
                return _utility_result(reply)
            self.pending.append(outputs)


class AsyncMPClient(MPClient):
    """For AsyncLLM: one reader (AsyncLLM's output handler) calls get_output_async()."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        super().__init__(zmq.asyncio.Context.instance(), env)
        self.utility_futures: dict[int, asyncio.Future] = {}

    async def wait_for_ready_async(self) -> EngineCoreReady:
        """`wait_for_ready()` without holding the event loop (and cancellable)."""
        while not await self.output_socket.poll(_POLL_MS):
            if self.proc.poll() is not None and not await self.output_socket.poll(_POLL_MS):
                raise self._exited_during_startup()
        return self._read_ready(await self.output_socket.recv_multipart())

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send_async(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send_async(EngineCoreRequestType.ABORT, request_ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        call_id = next(self.call_ids)
        future = asyncio.get_running_loop().create_future()
        self.utility_futures[call_id] = future
        await self._send_async(EngineCoreRequestType.UTILITY, (call_id, method, list(args)))
        return await future

    async def get_output_async(self) -> EngineCoreOutputs:
        while True:
            try:
                outputs = await self._recv_async()
            except EngineDeadError as e:
                self._fail_utility_calls(e)
                raise
            reply = outputs.utility_output
            if reply is None:
                return outputs
            future = self.utility_futures.pop(reply.call_id, None)
            if future is not None and not future.done():
                _resolve(future, reply)

    async def _recv_async(self) -> EngineCoreOutputs:
        while not await self.output_socket.poll(_ASYNC_POLL_MS):
            self._check_alive()
        return self._decode(await self.output_socket.recv_multipart())

    def _fail_utility_calls(self, error: Exception) -> None:
        for future in self.utility_futures.values():
            if not future.done():
                future.set_exception(error)
        self.utility_futures.clear()

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError("AsyncMPClient is read with get_output_async()")

    def call_utility(self, method: str, *args: Any) -> Any:
        raise NotImplementedError("AsyncMPClient uses call_utility_async()")


def _utility_result(reply) -> Any:
    if reply.failure_message is not None:
        raise RuntimeError(f"utility call failed in EngineCore: {reply.failure_message}")
    return reply.result


def _resolve(future: asyncio.Future, reply) -> None:
    try:
        future.set_result(_utility_result(reply))
    except RuntimeError as e:
        future.set_exception(e)
