"""AsyncLLM: the engine for servers. `generate()` is an async iterator of RequestOutputs.

One background task (the output handler) pulls outputs from the engine core and routes
them, through the OutputProcessor, to one asyncio.Queue per request. Cancelling a
`generate()` iterator aborts its request in the core, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from pagellm.config import EngineArgs, EngineConfig
from pagellm.engine.core_client import EngineDeadError, start_engine
from pagellm.engine.input_processor import InputProcessor, PromptType
from pagellm.engine.output_processor import OutputProcessor, fan_out
from pagellm.engine.stat_logger import StatLogger
from pagellm.outputs import RequestOutput
from pagellm.protocol import SchedulerStats
from pagellm.sampling_params import SamplingParams
from pagellm.tracing import trace_caller

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, config: EngineConfig, tokenizer: Any | None, engine_core: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(config.model_config, tokenizer)
        self.output_processor = OutputProcessor(tokenizer)
        self.engine_core = engine_core
        self.output_handler: asyncio.Task | None = None
        self.dead_error: BaseException | None = None
        self.last_stats: SchedulerStats | None = None
        self.stat_logger = StatLogger(config.log_stats_interval, config.device)
        self.tracer = trace_caller(self) if config.trace else None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        return cls(*start_engine(engine_args, asyncio_mode=True))

    @property
    def errored(self) -> bool:
        """True once the core is dead, even while idle (the core process is checked)."""
        if self.dead_error is None and not self.engine_core.is_alive():
            self._fail_all(EngineDeadError("EngineCore process exited unexpectedly"))
        return self.dead_error is not None

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yields this request's outputs as its `output_kind` asks; the last one is finished.
        A request the engine fails (a grammar that does not compile) raises ValueError."""
        queue = await self.add_request(request_id, prompt, sampling_params, priority)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:  # cancelled, disconnected or failed: free the core's blocks
                await self.abort(request_id)

    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> asyncio.Queue:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        self._start_output_handler()
        prompt_text, request = self.input_processor.process_inputs(
            request_id, prompt, params, priority=priority
        )
        queue: asyncio.Queue = asyncio.Queue()
        for child, parent, index in fan_out(request):
            self.output_processor.add_request(prompt_text, child, parent, index, queue)
            await self.engine_core.add_request_async(child)
        return queue

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        to_abort = self.output_processor.abort_requests(ids)
        if to_abort and self.dead_error is None:
            await self.engine_core.abort_requests_async(to_abort)

    async def call_utility(self, method: str, *args: Any) -> Any:
        self._start_output_handler()
        return await self.engine_core.call_utility_async(method, *args)

    def _start_output_handler(self) -> None:
        if self.output_handler is None:
            self.output_handler = asyncio.create_task(self._run_output_handler())

    async def _run_output_handler(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                if outputs.scheduler_stats is not None:
                    self.last_stats = outputs.scheduler_stats
                    self.stat_logger.record(outputs.scheduler_stats)
                _, reqs_to_abort = self.output_processor.process_outputs(outputs.outputs)
                if reqs_to_abort:
                    await self.engine_core.abort_requests_async(reqs_to_abort)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            logger.error("the engine is dead: %s", e)
            self._fail_all(e if isinstance(e, EngineDeadError) else EngineDeadError(str(e)))

    def _fail_all(self, error: EngineDeadError) -> None:
        self.dead_error = error
        for state in self.output_processor.request_states.values():
            if state.queue is not None:
                state.queue.put_nowait(error)
        self.output_processor.request_states.clear()
        self.output_processor.parents.clear()

    def shutdown(self) -> None:
        if self.output_handler is not None:
            self.output_handler.cancel()
        self.engine_core.shutdown()
        if self.tracer is not None:
            self.tracer.write(self.config.trace)
