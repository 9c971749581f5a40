"""Executor: the layer between the EngineCore and the ranks that hold the model.

The EngineCore calls only `determine_num_kv_blocks()`, `initialize_kv_cache(n)`,
`execute_model(scheduler_output, grammar)` /
`execute_model_async(...)` (or, for a step whose
grammar masks wait for the previous step's tokens, `forward_async()` then `sample_async()`)
and `collective_rpc()`; it never knows how many ranks there are. Three implementations, chosen by
`ParallelConfig.distributed_executor_backend` (`pagellm.executor.executor_class`):

- `UniProcExecutor` ("uni"): the one ModelRunner in the EngineCore's process (no copies);
- `MultiprocExecutor` ("mp"): one worker process per rank on this machine;
- `RayDistributedExecutor` ("ray"): one Ray actor per rank, on one machine or many.

The last two share `DistributedExecutor`: each step is sent once to every rank, the ranks
run it together (their collectives keep them in step), and rank 0's output comes back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from pagellm.config import EngineConfig
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.structured_output.bitmask import GrammarBitmask


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.failure_callback: Callable[[str], None] | None = None

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """`callback(message)` runs (once, from another thread) if a rank dies while the
        EngineCore is not waiting on it; a waiting call raises instead."""
        self.failure_callback = callback

    @abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar: GrammarBitmask | None = None
    ) -> ModelRunnerOutput: ...

    @abstractmethod
    def execute_model_async(
        self, scheduler_output: SchedulerOutput, grammar: GrammarBitmask | None = None
    ) -> Any:
        """Queue the step; the result's `get_output()` waits for its ModelRunnerOutput.
        Outputs are read in the order the steps were queued."""

    def forward_async(self, scheduler_output: SchedulerOutput) -> Any:
        """Queue the step's forward pass; `sample_async()` queues its sampling once the grammar
        masks are known. Ranks in other processes take forward and sampling as one message,
        so by default the step only waits here (it loses the forward's overlap)."""
        return scheduler_output

    def sample_async(self, forwarded: Any, grammar: GrammarBitmask | None) -> Any:
        return self.execute_model_async(forwarded, grammar)

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Call `method(*args)` on every rank's Worker; their results, by rank."""

    def determine_num_kv_blocks(self) -> int:
        """The KV blocks every rank can hold: the minimum over ranks."""
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    @abstractmethod
    def shutdown(self) -> None: ...


class DistributedExecutor(Executor):
    """Ranks elsewhere (processes, Ray actors): each step goes to every rank once, encoded
    once, and only rank 0 answers (see `pagellm.worker.worker.Worker`).

    With async scheduling a rank answers a step with the output of the step queued before it
    (it queues the new one first), so the output of step N is the answer to step N + 1, or,
    when no step follows, to a `flush`. A subclass moves the bytes: `_send(method, payload)`
    sends to every rank and returns a `Reply` whose `get()` is rank 0's answer.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._encoder = msgspec.msgpack.Encoder()
        self._output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        self._newest: StepFuture | None = None  # the queued step nobody answered yet

    @abstractmethod
    def _send(self, method: str, payload: bytes) -> Reply: ...

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        payload = self._step_payload(scheduler_output, False, grammar)
        return self._decode_output(self._send("execute_model", payload).get())

    def execute_model_async(
        self, scheduler_output: SchedulerOutput, grammar: GrammarBitmask | None = None
    ) -> StepFuture:
        reply = self._send("execute_model", self._step_payload(scheduler_output, True, grammar))
        if self._newest is not None:
            self._newest.reply = reply  # ranks answer this step with the one before it
        self._newest = StepFuture(self)
        return self._newest

    def _step_payload(
        self, scheduler_output: SchedulerOutput, non_block: bool, grammar: GrammarBitmask | None
    ) -> bytes:
        wire = None if grammar is None else grammar.to_wire()
        return self._encoder.encode((scheduler_output, non_block, wire))

    def output_of(self, future: StepFuture) -> ModelRunnerOutput:
        if future.reply is None:  # the newest step: no step followed to carry its answer
            self._newest = None
            future.reply = self._send("flush", b"")
        return self._decode_output(future.reply.get())

    def _decode_output(self, answer: bytes) -> ModelRunnerOutput:
        return self._output_decoder.decode(answer)


class Reply(Protocol):
    def get(self) -> bytes:
        """Rank 0's answer, waiting for it (raises if a rank died meanwhile)."""


class StepFuture:
    """A step queued on the ranks; `get_output()` waits for its output (once)."""

    __slots__ = ("executor", "reply", "output")

    def __init__(self, executor: DistributedExecutor) -> None:
        self.executor = executor
        self.reply: Reply | None = None
        self.output: ModelRunnerOutput | None = None

    def get_output(self) -> ModelRunnerOutput:
        if self.output is None:
            self.output = self.executor.output_of(self)
        return self.output
