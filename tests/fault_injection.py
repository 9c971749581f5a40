"""The EngineCore process with faults planted, for tests: `python tests/fault_injection.py`.

A request whose id starts with one of these prefixes trips a fault in the child process:
- `die-input`: the input socket thread raises while reading it;
- `die-output`: the output socket thread raises while sending its outputs;
- `die-busy`: the busy loop raises in the step that holds it;
- `poison-add`: adding it to the scheduler raises (a fault of that request alone);
- `poison-step`: processing its sampled tokens raises (a fault of that request alone).
Every other request runs as usual. Tests point `core_client.CORE_PROCESS_ARGS` here.
"""

from __future__ import annotations

import msgspec

from pagellm.core.request import Request
from pagellm.core.scheduler import Scheduler
from pagellm.engine import core_proc
from pagellm.engine.core import EngineCore
from pagellm.protocol import EngineCoreRequestType


class InjectedFault(RuntimeError):
    pass


def _plant() -> None:
    read_input = core_proc.EngineCoreProc._read_input

    def faulty_read_input(self, kind, payload, decoder):
        if kind == EngineCoreRequestType.ADD and b"die-input" in bytes(payload.buffer):
            raise InjectedFault("injected fault in the input thread")
        return read_input(self, kind, payload, decoder)

    step = EngineCore.step

    def faulty_step(self):
        if any(rid.startswith("die-busy") for rid in self.scheduler.requests):
            raise InjectedFault("injected fault in the busy loop")
        return step(self)

    from_request = Request.from_engine_core_request.__func__

    def faulty_from_request(cls, request):
        if request.request_id.startswith("poison-add"):
            raise InjectedFault(f"injected fault adding {request.request_id}")
        return from_request(cls, request)

    process_sampled = Scheduler._process_sampled

    def faulty_process_sampled(self, request, *args):
        if request.request_id.startswith("poison-step"):
            raise InjectedFault(f"injected fault stepping {request.request_id}")
        return process_sampled(self, request, *args)

    core_proc.EngineCoreProc._read_input = faulty_read_input
    EngineCore.step = faulty_step
    Request.from_engine_core_request = classmethod(faulty_from_request)
    Scheduler._process_sampled = faulty_process_sampled
    msgspec.msgpack.Encoder = _FaultyEncoder


class _FaultyEncoder:
    """msgspec's encoder, except for outputs of a `die-output` request (the output thread's)."""

    def __init__(self, *args, **kwargs) -> None:
        self.encoder = _REAL_ENCODER(*args, **kwargs)

    def encode(self, message):
        return self.encoder.encode(message)

    def encode_into(self, message, buffer, *args):
        outputs = getattr(message, "outputs", None) or []
        if any(out.request_id.startswith("die-output") for out in outputs):
            raise InjectedFault("injected fault in the output thread")
        return self.encoder.encode_into(message, buffer, *args)


_REAL_ENCODER = msgspec.msgpack.Encoder

if __name__ == "__main__":
    _plant()
    core_proc.main()
