"""`LoRARequest`: the adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`).

It crosses the process boundary inside `EngineCoreRequest`, so it is a msgspec struct of
plain values. `lora_int_id` (>= 1) is the adapter's identity everywhere: slots, the host
cache, the prefix-cache hash chain.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        # msgpack carries it to the engine core: at most a uint64, and never a bool
        if type(self.lora_int_id) is not int or not 1 <= self.lora_int_id < 2**64:
            raise ValueError(f"lora_int_id must be an int in [1, 2**64), got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path is required")
        if not isinstance(self.lora_path, str):  # a pathlib.Path: msgpack carries str only
            self.lora_path = os.fspath(self.lora_path)

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


def lora_id(lora_request: LoRARequest | None) -> int:
    """The adapter id of a request (0: the base model)."""
    return 0 if lora_request is None else lora_request.lora_int_id


def fits_lora_slots(lora_request: LoRARequest | None, running: Iterable, max_loras: int) -> bool:
    """Whether admitting a request keeps the adapters of the running requests (objects with a
    `lora_request`) within `max_loras` slots: a step never needs more adapters than slots."""
    new = lora_id(lora_request)
    if new == 0 or max_loras <= 0:
        return True
    ids = {lora_id(r.lora_request) for r in running} - {0}
    return new in ids or len(ids) < max_loras
