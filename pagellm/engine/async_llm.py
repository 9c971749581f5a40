"""AsyncLLM: the engine for servers. `generate()` is an async iterator of RequestOutputs.

One background task (the output handler) pulls outputs from the engine core and routes
them, through the OutputProcessor, to one asyncio.Queue per request. Cancelling a
`generate()` iterator aborts its request in the core, which frees its KV blocks.

Text prompts are tokenized in a worker thread (the tokenizers library releases the GIL), so a
long prompt never holds the event loop. When the core dies, every waiting iterator raises
EngineDeadError and `wait_dead()` returns; `restart_engine_core()` puts a new core in its place:
the spare that `keep_spare()` keeps ready (`SpareCore`), or a new process. Every core after the
first computes with the first one's CPU GEMM plan (not timed anew), so it gives the same outputs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from pagellm.config import EngineConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core_client import AsyncMPClient, EngineDeadError, start_engine
from pagellm.engine.input_processor import InputProcessor, PromptType
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.spare_core import SpareCore, resolve_spare
from pagellm.engine.stat_logger import StatLogger
from pagellm.lora.request import LoRARequest
from pagellm.outputs import PoolingRequestOutput, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.protocol import SchedulerStats
from pagellm.sampling_params import SamplingParams
from pagellm.tracing import CallerTracer, now_us

logger = logging.getLogger(__name__)

# after a hand-over the next spare starts this much later: its imports and loading beside the
# new core slowed that core's first requests by 0.5-3 s on 2 cores (docs/notes.md)
SPARE_DELAY_S = 5.0


class AsyncLLM:
    def __init__(self, config: EngineConfig, tokenizer: Any | None, engine_core: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(
            config.model_config,
            tokenizer,
            config.structured_outputs_config,
            config.reasoning_parser,
            config.lora_config,
        )
        self.tracer = CallerTracer() if config.trace else None
        self.output_processor = OutputProcessor(tokenizer, self.tracer)
        self.engine_core = engine_core
        self.core_env = _core_env(engine_core)  # the environment of the cores started later
        self.spare_mode = "none"  # keep_spare()
        self.spare: SpareCore | None = None
        self.spare_timer: asyncio.TimerHandle | None = None  # the next spare's start
        self.output_handler: asyncio.Task | None = None
        self.dead_error: BaseException | None = None
        self.dead = asyncio.Event()  # set with dead_error
        self.last_stats: SchedulerStats | None = None
        self.stat_logger = StatLogger(config.log_stats_interval, config.device)

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
        sampling_params: SamplingParams | PoolingParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields this request's outputs as its `output_kind` asks; the last one is finished.
        A request the engine fails (a grammar that does not compile) raises ValueError."""
        queue = await self.add_request(request_id, prompt, sampling_params, priority, lora_request)
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

    async def encode(
        self, prompt: PromptType, pooling_params: PoolingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling model's request (vLLM's `AsyncLLM.encode`): one finished output, its
        pooled vector."""
        async for out in self.generate(prompt, pooling_params, request_id, priority):
            yield out

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> asyncio.Queue:
        self._check_alive()
        self.start()
        tracer = self.tracer
        start = now_us() if tracer is not None else 0.0
        process = self.input_processor.process_inputs
        if _needs_tokenizing(prompt):  # off the event loop
            prompt_text, request = await asyncio.to_thread(
                process, request_id, prompt, params, priority=priority, lora_request=lora_request
            )
            self._check_alive()
        else:
            prompt_text, request = process(
                request_id, prompt, params, priority=priority, lora_request=lora_request
            )
        if tracer is not None:
            tracer.input_processing(start, request)
        queue: asyncio.Queue = asyncio.Queue()
        core = self.engine_core
        with self.output_processor.adding(
            prompt_text, request, core.abort_requests, queue
        ) as children:
            for child in children:
                start = now_us() if tracer is not None else 0.0
                await core.add_request_async(child)
                if tracer is not None:
                    tracer.zmq_send(start, child.request_id)
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

    def keep_spare(self, mode: str) -> None:
        """Keep a spare EngineCore process for `restart_engine_core()` from now on: "loaded",
        "imported", "none" or "auto" (`SpareCore`). Call it in the running event loop."""
        self.spare_mode = resolve_spare(mode, self.config.device)
        self._start_spare()

    def _start_spare(self) -> None:
        self.spare_timer = None
        if self.spare_mode != "none" and isinstance(self.engine_core, AsyncMPClient):
            self.spare = SpareCore(self.config, self.spare_mode == "loaded", self.core_env)

    async def restart_engine_core(self) -> None:
        """A new EngineCore (the same config) in place of a dead one: the spare, or a new
        process. Requests of the old one have already failed with EngineDeadError; new ones
        are refused until it is up. The next spare starts SPARE_DELAY_S later."""
        if self.spare_timer is not None:  # the core died again before the spare started
            self.spare_timer.cancel()
        if self.output_handler is not None:
            self.output_handler.cancel()
            self.output_handler = None
        await asyncio.to_thread(self.engine_core.shutdown)
        self.engine_core = await self._new_core()
        self.output_processor = OutputProcessor(self.tokenizer, self.tracer)
        self.last_stats = None
        self.stat_logger = StatLogger(self.config.log_stats_interval, self.config.device)
        self.dead_error = None
        self.dead.clear()
        self.start()
        self.spare_timer = asyncio.get_running_loop().call_later(SPARE_DELAY_S, self._start_spare)

    async def _new_core(self) -> AsyncMPClient:
        spare, self.spare = self.spare, None
        if spare is not None:
            try:
                return await spare.take()
            except Exception as e:
                logger.warning("the spare engine core is lost (%s): starting a new one", e)
        client = AsyncMPClient(self.core_env)
        try:
            client.start_core(self.config)
            await client.wait_for_ready_async()
        except BaseException:
            client.shutdown()
            raise
        return client

    async def _run_output_handler(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                if self.tracer is not None:
                    self.tracer.output_received(outputs)
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
        if self.spare_timer is not None:
            self.spare_timer.cancel()
        if self.spare is not None:
            self.spare.shutdown()
        self.engine_core.shutdown()
        if self.tracer is not None:
            self.tracer.write(self.config.trace)


def _core_env(engine_core: Any) -> dict[str, str]:
    """The first core's CPU GEMM plan (if it chose one) for the cores started after it."""
    ready = getattr(engine_core, "ready", None)
    plan = None if ready is None else ready.cpu_gemm_plan
    return {} if plan is None else {"PAGELLM_CPU_GEMM_PLAN": plan}


def _needs_tokenizing(prompt: PromptType) -> bool:
    if isinstance(prompt, dict):
        return "prompt_token_ids" not in prompt
    return isinstance(prompt, str)
