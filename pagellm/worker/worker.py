"""Worker: one tensor-parallel rank, as the executors drive it (in a worker process, or a Ray
actor): its process group, its device, its ModelRunner, and the step protocol.

Every rank runs every step on its shard of the model; only rank 0 answers. With async
scheduling a rank keeps one step in flight, as the EngineCore does with one rank: the step
that arrives is queued on the device first, then the one before it is read back and (rank 0)
answered. `flush()` reads back the step still in flight when no next step comes.

`handle(method, payload)` is the wire form both transports use (msgpack in, msgpack out):

    "execute_model" (SchedulerOutput, non_block, grammar bitmask wire | None)
                                                 -> rank 0: the ModelRunnerOutput, if any
    "flush"                                      -> rank 0: the step in flight's, if any
    "rpc" (call id, method, args)                -> every rank: (call id, ok, result)
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence

import msgspec
import torch

from pagellm.config import EngineConfig
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from pagellm.lora.request import LoRARequest
from pagellm.structured_output.bitmask import GrammarBitmask, GrammarBitmaskWire
from pagellm.worker.async_output import AsyncModelRunnerOutput

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        local_rank: int = 0,
        store: tuple[str, int] | None = None,
    ) -> None:
        """`store`: host and port of the TCPStore the ranks meet at (None: one rank)."""
        if store is not None:
            config = _join_group(config, rank, local_rank, store)
        from pagellm.worker.model_runner import ModelRunner

        self.rank = rank
        self.model_runner = ModelRunner(config)
        self.in_flight: AsyncModelRunnerOutput | None = None
        self._step_decoder = msgspec.msgpack.Decoder(
            tuple[SchedulerOutput, bool, GrammarBitmaskWire | None]
        )
        self._encoder = msgspec.msgpack.Encoder()

    def handle(self, method: str, payload: bytes) -> bytes | None:
        """Run one message from the executor; its encoded answer, or None (no answer)."""
        if method == "execute_model":
            output = self.execute_model(*self._step_decoder.decode(payload))
        elif method == "flush":
            output = self.flush()
        elif method == "rpc":
            return self._encoder.encode(self._rpc(*msgspec.msgpack.decode(payload)))
        else:
            raise ValueError(f"unknown message {method!r}")
        return None if output is None else self._encoder.encode(output)

    def _rpc(self, call_id: int, method: str, args: list) -> tuple[int, bool, object]:
        if method.startswith("_") or method == "handle" or not hasattr(self, method):
            return call_id, False, f"Worker has no method {method!r}"
        return call_id, True, getattr(self, method)(*args)

    def determine_num_kv_blocks(self) -> int:
        return self.model_runner.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        non_block: bool,
        grammar: GrammarBitmaskWire | None = None,
    ) -> ModelRunnerOutput | None:
        """Run one step. non_block: queue it, and return the output of the step queued
        before it (None if there is none); else return this step's output. Rank 0 only."""
        bitmask = None if grammar is None else GrammarBitmask.from_wire(grammar)
        queued = self.model_runner.execute_model_async(scheduler_output, bitmask)
        if non_block:
            previous, self.in_flight = self.in_flight, queued
            return self._answer(previous)
        return self._answer(queued)

    def flush(self) -> ModelRunnerOutput | None:
        """The output of the step still in flight (rank 0; None if there is none)."""
        previous, self.in_flight = self.in_flight, None
        return self._answer(previous)

    def _answer(self, queued: AsyncModelRunnerOutput | None) -> ModelRunnerOutput | None:
        if queued is None:
            return None
        output = queued.get_output()  # every rank reads its sampled ids back
        return output if self.rank == 0 else None

    def add_lora(
        self, lora_name: str, lora_int_id: int, lora_path: str, live: Sequence[int] = ()
    ) -> str | None:
        """Read an adapter into the runner's host cache before its first request runs;
        its error's text (the request fails alone), or None."""
        if self.model_runner.lora is None:
            return "LoRA is off: start the engine with enable_lora=True"
        try:
            self.model_runner.lora.add_adapter(LoRARequest(lora_name, lora_int_id, lora_path), live)
        except (ValueError, OSError) as e:
            return str(e)
        return None

    def describe(self) -> dict:
        """This rank's process, device and shard sizes (for logs, tests and the planner's
        check, benchmarks/plan_check.py)."""
        runner = self.model_runner
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "device": str(runner.device),
            "num_kv_heads": runner.num_kv_heads,
            "weight_bytes": runner.weight_bytes,
            "kv_block_bytes": runner.kv_block_bytes,
            "kv_cache_bytes": sum(t.numel() * t.element_size() for t in runner.kv_caches),
            "profiled": None if runner.profiled is None else runner.profiled._asdict(),
        }

    def shutdown(self) -> None:
        self.model_runner.kv_caches = []
        destroy_tensor_parallel()


def _join_group(config: EngineConfig, rank: int, local_rank: int, store: tuple[str, int]):
    """Pick this rank's device (GPU `local_rank`, or a share of the CPU's cores), join the
    process group; the config with this rank's device."""
    tp = config.parallel_config.tensor_parallel_size
    device = torch.device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        config = dataclasses.replace(config, device=str(device))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    init_tensor_parallel(rank, tp, *store, device)
    logger.info("rank %d of %d on %s, pid %d", rank, tp, device, os.getpid())
    return config
