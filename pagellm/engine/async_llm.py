"""AsyncLLM: the engine for servers. `generate()` is an async iterator of RequestOutputs.

One background task (the output handler) pulls outputs from the engine core and routes
them, through the OutputProcessor, to one asyncio.Queue per request. Cancelling a
`generate()` iterator aborts its request in the core, which frees its KV blocks.

Text prompts are tokenized in a worker thread (the tokenizers library releases the GIL), so a
long prompt never holds the event loop. When the core dies, every waiting iterator raises
EngineDeadError and `wait_dead()` returns; `restart_engine_core()` starts a new core in place.
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
        self.input_processor = InputProcessor(
            config.model_config, tokenizer, config.structured_outputs_config
        )
        self.output_processor = OutputProcessor(tokenizer)
        self.engine_core = engine_core
        self.output_handler: asyncio.Task | None = None
        self.dead_error: BaseException | None = None
        self.dead = asyncio.Event()  # set with dead_error
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
        self._check_alive()
        self.start()
        process = self.input_processor.process_inputs
        if _needs_tokenizing(prompt):  # off the event loop
            prompt_text, request = await asyncio.to_thread(
                process, request_id, prompt, params, priority=priority
            )
            self._check_alive()
        else:
            prompt_text, request = process(request_id, prompt, params, priority=priority)
        queue: asyncio.Queue = asyncio.Queue()
        added: list[str] = []
        try:
            for child, parent, index in fan_out(request):
                self.output_processor.add_request(prompt_text, child, parent, index, queue)
                added.append(child.request_id)
                await self.engine_core.add_request_async(child)
        except BaseException:
            self.output_processor.withdraw(added, self.engine_core.abort_requests)
            raise
        return queue

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))

    @property
    def num_unfinished_requests(self) -> int:
        """Engine requests not yet finished (n > 1 counts its n children)."""
        return self.output_processor.get_num_unfinished_requests()

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        to_abort = self.output_processor.abort_requests(ids)
        if to_abort and self.dead_error is None:
            await self.engine_core.abort_requests_async(to_abort)

    async def call_utility(self, method: str, *args: Any) -> Any:
        self._check_alive()
        self.start()
        return await self.engine_core.call_utility_async(method, *args)

    def start(self) -> None:
        """Start the output handler (in the running loop); it also notices an idle core die."""
        if self.output_handler is None:
            self.output_handler = asyncio.create_task(self._run_output_handler())

    async def wait_dead(self) -> BaseException:
        """Returns the error once the core is dead."""
        await self.dead.wait()
        return self.dead_error

    async def restart_engine_core(self) -> None:
        """A new EngineCore process (the same config) in place of a dead one. Requests of the
        old one have already failed with EngineDeadError; new ones are refused until it is up."""
        if self.output_handler is not None:
            self.output_handler.cancel()
            self.output_handler = None
        old = self.engine_core
        await asyncio.to_thread(old.shutdown)
        client = type(old)()
        try:
            client.start_core(self.config)
            await asyncio.to_thread(client.wait_for_ready)
        except BaseException:
            client.shutdown()
            raise
        self.engine_core = client
        self.output_processor = OutputProcessor(self.tokenizer)
        self.last_stats = None
        self.dead_error = None
        self.dead.clear()
        self.start()

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
        self.dead.set()
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


def _needs_tokenizing(prompt: PromptType) -> bool:
    if isinstance(prompt, dict):
        return "prompt_token_ids" not in prompt
    return isinstance(prompt, str)
