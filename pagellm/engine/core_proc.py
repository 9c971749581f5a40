"""EngineCoreProc: the EngineCore in its own process, behind two ZMQ sockets.

The client starts `python -m pagellm.engine.core_proc IPC_DIR` (nothing of the caller's
`__main__` is re-imported, so no `if __name__ == "__main__":` guard is needed); while it
imports, the caller resolves the `EngineConfig` and sends it as msgpack on stdin (`to_wire()`:
the HF config as a plain dict, so this process never imports transformers), with the socket
paths in IPC_DIR, which the process removes if its parent dies. Two threads move
bytes: one decodes input messages into a queue, one encodes outputs from a queue, so
serialization overlaps the forward pass.
`run_busy_loop()` blocks on the input queue while there is nothing to do, and otherwise
drains it and runs `EngineCore.step()`.

No thread dies alone: if any of the three raises, the client is told (a FAILED message) and the
process exits, so that every caller gets EngineDeadError instead of waiting forever. A request
that cannot be decoded (a wrong type in its params) fails alone, with an ERROR output.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import queue
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from pagellm.config import EngineConfig
from pagellm.core.sampled import error_output
from pagellm.engine.core import EngineCore
from pagellm.engine.core_process import DEATH_REPORT
from pagellm.protocol import (
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
)
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger("pagellm.engine.core_proc")

_POLL_S = 0.5  # how often an idle core checks that its parent is alive
_DIED = "died"  # input queue entry: a socket thread has died, the loop must end
_FAILED = "failed"  # input queue entry: the ERROR output of a request that could not be read


class EngineCoreProc(EngineCore):
    def __init__(self, config: EngineConfig, ctx: zmq.Context, input_path: str) -> None:
        super().__init__(config)
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.ctx = ctx
        self.input_path = input_path
        self.model_executor.register_failure_callback(self._executor_failed)
        threading.Thread(target=self._input_thread, daemon=True, name="core-input").start()

    def _executor_failed(self, message: str) -> None:
        """A rank died while nothing waited on it: report now, then stop the loop."""
        self.output_queue.put((EngineCoreOutputType.FAILED, ["RuntimeError", message]))
        self.input_queue.put((EngineCoreRequestType.SHUTDOWN, None))

    # ---- socket threads ---------------------------------------------------------------

    def _input_thread(self) -> None:
        try:
            sock = self.ctx.socket(zmq.PULL)
            sock.connect(self.input_path)
            add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
            while True:
                kind, payload = sock.recv_multipart(copy=False)
                self._read_input(EngineCoreRequestType(bytes(kind.buffer)), payload, add_decoder)
        except BaseException as e:
            self._input_thread_died(e)

    def _read_input(self, kind: EngineCoreRequestType, payload: Any, add_decoder: Any) -> None:
        if kind != EngineCoreRequestType.ADD:
            self.input_queue.put((kind, msgspec.msgpack.decode(payload.buffer)))
            return
        try:
            request = add_decoder.decode(payload.buffer)
        except msgspec.ValidationError as e:  # this request's fault, if its id can be read
            request_id = msgspec.msgpack.decode(payload.buffer)[0]
            if not isinstance(request_id, str):
                raise
            logger.error("request %r cannot be decoded: %s", request_id, e)
            error = ValueError(_name_fields(str(e)))
            self.input_queue.put((_FAILED, error_output(request_id, error)))
            return
        if self.tracer is not None:
            self.tracer.input_queue(request.request_id)
        self.input_queue.put((kind, request))

    def _input_thread_died(self, error: BaseException) -> None:
        """Tell the client now (the loop may be in a long step), then end the loop."""
        logger.error("EngineCore input thread died:\n%s", traceback.format_exc())
        message = ["InputThreadDied", f"the input thread died: {type(error).__name__}: {error}"]
        self.output_queue.put((EngineCoreOutputType.FAILED, message))
        self.input_queue.put((_DIED, message[1]))

    def output_thread(self, sock: zmq.Socket, report_path: str) -> None:
        """Sends the output queue; a FAILED message is also written to `report_path` first
        (`write_death_report`)."""
        try:
            encoder = msgspec.msgpack.Encoder()
            buffer = bytearray()
            while True:
                kind, message = self.output_queue.get()
                if kind is None:  # the loop has ended: everything before this is sent
                    return
                encoder.encode_into(message, buffer)
                if kind == EngineCoreOutputType.FAILED:
                    write_death_report(report_path, bytes(buffer))
                sock.send_multipart((kind.value, buffer), copy=True)
        except BaseException as e:
            _output_thread_died(sock, e, report_path)

    # ---- the loop -----------------------------------------------------------------------

    def run_busy_loop(self) -> None:
        while True:
            self._drain_input_queue(block=not self.has_unfinished_requests())
            if self.has_unfinished_requests():
                outputs = self.step()
                if outputs.outputs:
                    self.output_queue.put((EngineCoreOutputType.OUTPUTS, outputs))

    def _drain_input_queue(self, block: bool) -> None:
        if block:
            self._handle(*self.input_queue.get())  # idle: sleep until something arrives
        while not self.input_queue.empty():
            self._handle(*self.input_queue.get_nowait())

    def _handle(self, kind: EngineCoreRequestType | str, message: Any) -> None:
        if kind == _DIED:
            raise RuntimeError(message)
        if kind == _FAILED:
            self.failed.append(message)
        elif kind == EngineCoreRequestType.ADD:
            self.add_request(message)
        elif kind == EngineCoreRequestType.ABORT:
            self.abort_requests(message)
        elif kind == EngineCoreRequestType.UTILITY:
            self._run_utility(*message)
        elif kind == EngineCoreRequestType.SHUTDOWN:
            raise SystemExit(0)

    def _run_utility(self, call_id: int, method: str, args: list) -> None:
        try:
            reply = UtilityOutput(call_id, result=self.call_utility(method, args))
        except Exception as e:  # the caller gets the error; the core carries on
            reply = UtilityOutput(call_id, failure_message=f"{type(e).__name__}: {e}")
        outputs = EngineCoreOutputs(utility_output=reply, timestamp=time.monotonic())
        self.output_queue.put((EngineCoreOutputType.OUTPUTS, outputs))


def _name_fields(message: str) -> str:
    """msgspec says where a request failed to decode by position (`$[2][11]`: the structs are
    array-like); say it by name (`SamplingParams.max_tokens`)."""
    match = re.search(r"\$\[(\d+)\](?:\[(\d+)\])?", message)
    if match is None:
        return message
    field = EngineCoreRequest.__struct_fields__[int(match.group(1))]
    if field == "sampling_params" and match.group(2) is not None:
        field = f"SamplingParams.{SamplingParams.__struct_fields__[int(match.group(2))]}"
    return f"{message[: match.start()]}{field}{message[match.end() :]}"


def write_death_report(path: str, payload: bytes) -> None:
    """The FAILED message's payload ([error type, message], msgpack) as a file beside the
    sockets, whole before the process can exit: the client reads it when it sees the exit, so
    the reason never depends on the frame winning the race to the socket (it can lose on a
    loaded machine). The first report stays: a later one is a consequence of it."""
    if os.path.exists(path):
        return
    try:
        with open(path + ".tmp", "wb") as f:
            f.write(payload)
        os.replace(path + ".tmp", path)
    except OSError:  # the directory is gone (the client shut down): the socket still tells
        pass


def _output_thread_died(sock: zmq.Socket, error: BaseException, report_path: str) -> None:
    """Nothing can reach the client any more: tell it if the socket still works, then exit
    (the client sees the process end within its poll interval)."""
    logger.error("EngineCore output thread died:\n%s", traceback.format_exc())
    try:
        message = ["OutputThreadDied", f"the output thread died: {type(error).__name__}: {error}"]
        write_death_report(report_path, msgspec.msgpack.encode(message))
        frames = (EngineCoreOutputType.FAILED.value, msgspec.msgpack.encode(message))
        sent = sock.send_multipart(frames, copy=False, track=True)
        sent.wait(_POLL_S)  # handed to ZMQ's I/O thread: it goes out before the exit
        time.sleep(0.05)
    finally:
        logging.shutdown()
        os._exit(1)


def _watch_parent(parent_pid: int, ipc_dir: str) -> None:
    """Exit when the parent is gone (even after SIGKILL), removing the IPC files."""
    while os.getppid() == parent_pid:
        time.sleep(_POLL_S)
    shutil.rmtree(ipc_dir, ignore_errors=True)
    os._exit(0)


def run_engine_core(config: EngineConfig, input_path: str, output_path: str, ipc_dir: str):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    threading.Thread(target=_watch_parent, args=(os.getppid(), ipc_dir), daemon=True).start()
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.connect(output_path)
    try:
        core = EngineCoreProc(config, ctx, input_path)
    except SystemExit:  # stopped (SIGTERM) while it loads, a spare's shutdown: no failure
        raise
    except BaseException as e:
        _send_failure(out, [type(e).__name__, str(e)])
        raise
    core.output_queue.put((EngineCoreOutputType.READY, _ready(core)))
    report = os.path.join(ipc_dir, DEATH_REPORT)
    writer = threading.Thread(target=core.output_thread, args=(out, report), name="core-output")
    writer.start()
    try:
        core.run_busy_loop()
    except SystemExit:
        pass
    except BaseException as e:
        logger.error("EngineCore died:\n%s", traceback.format_exc())
        core.output_queue.put((EngineCoreOutputType.FAILED, [type(e).__name__, str(e)]))
        raise
    finally:
        core.shutdown()  # stops tensor-parallel workers now, not when they miss their parent
        core.output_queue.put((None, None))
        writer.join(timeout=5)
        out.close(linger=2000)


def _ready(core: EngineCore) -> EngineCoreReady:
    from pagellm.kernels.cpu_gemm import chosen_plan_setting

    return EngineCoreReady(
        num_kv_blocks=core.num_kv_blocks,
        max_model_len=core.config.model_config.max_model_len,
        pid=os.getpid(),
        cpu_gemm_plan=chosen_plan_setting(),
    )


def _send_failure(sock: zmq.Socket, message: list[str]) -> None:
    logger.error("EngineCore failed to start:\n%s", traceback.format_exc())
    sock.send_multipart((EngineCoreOutputType.FAILED.value, msgspec.msgpack.encode(message)))
    sock.close(linger=2000)


def main() -> None:
    from pagellm.logger import setup_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's, even while waiting
    # `kill -USR1 <pid>` prints every thread's Python stack to stderr: where a stuck core waits
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    setup_logging()
    logger.info("EngineCore process %d: imports done, waiting for the config", os.getpid())
    ipc_dir = sys.argv[1]
    message = sys.stdin.buffer.read()  # the caller's config, once it has resolved it
    if not message:  # the caller gave up before sending it, or died (a spare that waited)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        return
    wire_config, input_path, output_path = msgspec.msgpack.decode(message)
    code = 0
    try:
        run_engine_core(EngineConfig.from_wire(wire_config), input_path, output_path, ipc_dir)
    except SystemExit:  # SIGTERM while it loaded
        pass
    except BaseException:
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no waiting on ZMQ's context teardown while a socket thread still reads


if __name__ == "__main__":
    # run the imported module's main(), not this __main__ copy's: one EngineCoreProc class
    from pagellm.engine import core_proc

    core_proc.main()
