"""EngineCore: the scheduler and the model runner, one step at a time.

`step()` is the whole engine loop body: Scheduler.schedule() -> ModelRunner.execute_model()
-> Scheduler.update_from_output(). EngineCoreProc (the child-process wrapper that runs
`step()` in a busy loop behind ZMQ sockets) lives beside it.

With async scheduling (the default on CUDA) one step stays in flight: `step()` schedules and
queues step N+1 on the device while step N still runs there, then waits for step N's tokens
and returns its outputs. The host's scheduling, input preparation and output handling thus
overlap the device's work instead of adding to it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pagellm.config import EngineConfig
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sched_output import SchedulerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.engine.protocol import EngineCoreOutputs, EngineCoreRequest
from pagellm.worker.async_output import AsyncModelRunnerOutput
from pagellm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.config = config
        self.model_runner = ModelRunner(config)
        self.num_kv_blocks = self.model_runner.determine_num_kv_blocks()
        self.model_runner.initialize_kv_cache(self.num_kv_blocks)
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            self.num_kv_blocks,
            config.log_stats,
            async_scheduling=config.async_scheduling,
            sliding_window=self.model_runner.kv_sliding_window(),
        )
        self.async_scheduling = config.async_scheduling
        # async scheduling: the step queued on the device whose outputs are not yet reported
        self._in_flight: tuple[SchedulerOutput, AsyncModelRunnerOutput] | None = None
        logger.info("EngineCore ready in %.1f s", time.perf_counter() - start)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> EngineCoreOutputs:
        if self.async_scheduling:
            return self._step_async()
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(timestamp=time.monotonic())
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _step_async(self) -> EngineCoreOutputs:
        """Queue the next step, then report the one before it (empty on the first call)."""
        previous, self._in_flight = self._in_flight, None
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            queued = self.model_runner.execute_model_async(scheduler_output)
            self._in_flight = (scheduler_output, queued)
        if previous is None:
            return EngineCoreOutputs(timestamp=time.monotonic())
        scheduler_output, queued = previous
        return self.scheduler.update_from_output(scheduler_output, queued.get_output())

    # ---- utility calls (by name, from the client) -----------------------------------------

    def call_utility(self, method: str, args: list[Any]) -> Any:
        if method not in _UTILITIES:
            raise ValueError(f"unknown utility method {method!r}")
        return getattr(self, method)(*args)

    def get_num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.num_free_blocks

    def get_num_kv_blocks(self) -> int:
        return self.num_kv_blocks

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def get_stats(self) -> dict[str, Any]:
        stats = self.scheduler.make_stats()
        return {f: getattr(stats, f) for f in stats.__struct_fields__}

    def shutdown(self) -> None:
        self.model_runner.kv_caches = []


_UTILITIES = {
    "get_num_free_blocks",
    "get_num_kv_blocks",
    "reset_prefix_cache",
    "get_stats",
    "abort_requests",
}
