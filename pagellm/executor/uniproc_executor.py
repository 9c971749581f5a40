"""UniProcExecutor: the one rank in the EngineCore's own process.

The step calls go straight to the ModelRunner: one method call, no copy of the scheduler
output, no process hop (tensor_parallel_size=1, the default).
"""

from __future__ import annotations

from typing import Any

from pagellm.config import EngineConfig
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.executor.abstract import Executor
from pagellm.structured_output.bitmask import GrammarBitmask
from pagellm.worker.async_output import AsyncModelRunnerOutput
from pagellm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.driver_worker = Worker(config)
        self.model_runner = self.driver_worker.model_runner

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output, grammar)

    def execute_model_async(
        self, scheduler_output: SchedulerOutput, grammar: GrammarBitmask | None = None
    ) -> AsyncModelRunnerOutput:
        return self.model_runner.execute_model_async(scheduler_output, grammar)

    def forward_async(self, scheduler_output: SchedulerOutput) -> Any:
        return self.model_runner.forward_async(scheduler_output)

    def sample_async(self, forwarded: Any, grammar: GrammarBitmask | None) -> Any:
        return self.model_runner.sample_async(forwarded, grammar)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args)]

    def shutdown(self) -> None:
        self.model_runner.kv_caches = []
