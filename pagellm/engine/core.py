"""EngineCore: the scheduler and the model runner, one step at a time.

`step()` is the whole engine loop body: Scheduler.schedule() -> Executor.execute_model()
-> Scheduler.update_from_output(). The executor (`pagellm/executor/`) runs the step on the
model's ranks: the ModelRunner in this process, or tensor-parallel workers. EngineCoreProc
(the child-process wrapper that runs `step()` in a busy loop behind ZMQ sockets) lives
beside it.

With async scheduling (the default on CUDA) one step stays in flight: `step()` schedules and
queues step N+1 on the device while step N still runs there, then waits for step N's tokens
and returns its outputs. The host's scheduling, input preparation and output handling thus
overlap the device's work instead of adding to it.

Structured outputs (`pagellm/structured_output/`): grammars compile in the manager's threads;
each step fills the bitmask rows of the constrained requests that sample, from their matchers,
which must first have seen the previous step's tokens. So under async scheduling a step with
such rows queues its forward, then waits for the step before it and reports it, then fills
the masks and queues its sampling: it keeps the forward's overlap, and loses the rest.

Speculative decoding (`pagellm/spec_decode/`): a step's drafts are proposed once its tokens
are back, and the next step verifies them. So under async scheduling, while drafts flow, each
step first reports the one in flight, then schedules and queues the next (which runs on the
device while the outputs go to the caller); while no request gets drafts (none found, or
the adaptive count at 0) steps overlap as without speculation, and drafts proposed for a
request whose next step is already queued are dropped (they follow a token now behind it).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pagellm import envs
from pagellm.config import EngineConfig
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sampled import error_output
from pagellm.core.sched_output import SchedulerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.executor import executor_class
from pagellm.kv_cache_size import kv_capacity_tokens, max_request_len
from pagellm.lora.request import LoRARequest
from pagellm.models.registry import kv_sliding_window
from pagellm.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from pagellm.structured_output.manager import StructuredOutputManager
from pagellm.tracing import CoreTracer, now_us

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.config = config
        self.structured_output = StructuredOutputManager(
            config.model_config,
            config.scheduler_config.max_num_seqs,
            config.async_scheduling,
            config.reasoning_parser,
            config.structured_outputs_config,
        )
        if envs.warm_grammar_backend(config.device):
            self.structured_output.warm_up()  # in a compile thread, beside the model's loading
        self.model_executor = executor_class(config)(config)
        self.num_kv_blocks = self.model_executor.determine_num_kv_blocks()
        self.model_executor.initialize_kv_cache(self.num_kv_blocks)
        window = kv_sliding_window(config.model_config.architecture, config.model_config.hf_config)
        self.config = config = fit_max_model_len(config, self.num_kv_blocks, window)
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            self.num_kv_blocks,
            config.log_stats,
            async_scheduling=config.async_scheduling,
            policy=config.scheduler_config.policy,
            sliding_window=window,
            long_rope_switch=config.model_config.long_rope_switch,
            speculative=config.speculative_config,
            max_loras=0 if config.lora_config is None else config.lora_config.max_loras,
        )
        self.async_scheduling = config.async_scheduling
        # speculative decoding: whether the last step reported came with drafts; while they
        # flow, each step is reported before the next is scheduled (they are its drafts)
        self.drafting = False
        # async scheduling: the step queued on the device whose outputs are not yet reported
        self._in_flight: tuple[SchedulerOutput, Any] | None = None  # (step, its future)
        self.failed: list[EngineCoreOutput] = []  # requests that could not be added, reported next
        self.tracer = CoreTracer(self.model_executor, config.trace_kv) if config.trace else None
        logger.info("EngineCore ready in %.1f s", time.perf_counter() - start)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. One that cannot be added (its params, its prompt, its grammar)
        fails alone: its ERROR output comes with the next step's outputs, and the engine carries
        on."""
        start = now_us() if self.tracer is not None else 0.0
        try:
            if request.lora_request is not None:
                self._add_lora(request.lora_request)
            req = Request.from_engine_core_request(request)
            self.structured_output.add_request(req)  # a grammar starts compiling in a thread
            self.scheduler.add_request(req)
        except Exception as e:
            logger.exception("request %r cannot be added", request.request_id)
            self.failed.append(error_output(request.request_id, e))
        if self.tracer is not None:
            self.tracer.add_request(start, request.request_id)

    def _add_lora(self, lora: LoRARequest) -> None:
        """A request's adapter read on every rank before it is queued, or found in their host
        caches (each request asks: one evicted since is read again, and one whose folder is
        gone fails its request alone, never a step)."""
        # every adapter a queued, preempted or running request still needs stays in the
        # host caches: a step never reads a folder (it may be gone since, or replaced)
        live = sorted({r.lora_request.lora_int_id for r in self.scheduler.requests.values()
                       if r.lora_request is not None})  # fmt: skip
        args = (lora.lora_name, lora.lora_int_id, lora.lora_path, live)
        errors = [e for e in self.model_executor.collective_rpc("add_lora", args) if e]
        if errors:
            raise ValueError(errors[0])

    def load_lora(self, lora_name: str, lora_int_id: int, lora_path: str) -> str | None:
        """An adapter read into every rank's host cache now (the server's runtime load, as
        vLLM reads it then); its error's text, or None."""
        try:
            self._add_lora(LoRARequest(lora_name, lora_int_id, lora_path))
        except ValueError as e:
            return str(e)
        return None

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(
            self.scheduler.has_unfinished_requests() or self._in_flight is not None or self.failed
        )

    def step(self) -> EngineCoreOutputs:
        outputs = self._step_async() if self.async_scheduling else self._step()
        if self.failed:
            outputs.outputs = self.failed + outputs.outputs
            self.failed = []
        return outputs

    def _step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(timestamp=time.monotonic())
        scheduler_output = self._schedule(idle=True)
        waiting = self.structured_output.sampling_requests(scheduler_output)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        grammar = self.structured_output.grammar_bitmask(waiting, drafts) if waiting else None
        start = self.tracer.execute_start() if self.tracer is not None else None
        runner_output = self.model_executor.execute_model(scheduler_output, grammar)
        if self.tracer is not None:
            self.tracer.execute_model(start, scheduler_output)
        return self._update_from_output(scheduler_output, runner_output)

    def _schedule(self, idle: bool) -> SchedulerOutput:
        """The next step; with nothing to run (nor `idle` step in flight) but grammars
        compiling, wait a little for them."""
        start = now_us() if self.tracer is not None else 0.0
        scheduler_output = self.scheduler.schedule()
        if self.tracer is not None:
            self.tracer.schedule(start, self.scheduler, scheduler_output)
        pending = self.scheduler.waiting_for_grammar
        if scheduler_output.total_num_scheduled_tokens == 0 and pending and idle:
            self.structured_output.wait_for_compiles([r.structured_output.future for r in pending])
        return scheduler_output

    def _step_async(self) -> EngineCoreOutputs:
        """Queue the next step, then report the one before it (empty on the first call)."""
        previous, self._in_flight = self._in_flight, None
        outputs = None
        if previous is not None and self.drafting:  # its drafts are the next step's
            outputs, previous = self._report(previous), None
        if self.scheduler.has_unfinished_requests():
            # an empty step in flight is no work to report: idle, wait for compiles (a busy
            # loop of empty steps starved the compile threads of the interpreter lock)
            scheduler_output = self._schedule(idle=previous is None or _is_empty(previous[0]))
            start = self.tracer.execute_start() if self.tracer is not None else None
            waiting = self.structured_output.sampling_requests(scheduler_output)
            if not waiting:
                queued = self.model_executor.execute_model_async(scheduler_output)
            else:  # their masks need the previous step's tokens: the sampling waits for them
                queued, reported = self._queue_constrained(scheduler_output, waiting, previous)
                outputs = reported or outputs  # drafting: the previous step is reported above
                previous = None
            if self.tracer is not None:
                self.tracer.execute_model(start, scheduler_output)
            self._in_flight = (scheduler_output, queued)
        if previous is not None:
            outputs = self._report(previous)
        return outputs or EngineCoreOutputs(timestamp=time.monotonic())

    def _queue_constrained(
        self, scheduler_output: SchedulerOutput, waiting: list, previous: tuple | None
    ) -> tuple[Any, EngineCoreOutputs | None]:
        """Queue a step whose grammar masks need the previous step's tokens: its forward,
        then the previous step's report (if any), then its sampling with the masks."""
        executor = self.model_executor
        forwarded = executor.forward_async(scheduler_output)
        outputs = self._report(previous) if previous is not None else None
        drafts = scheduler_output.scheduled_spec_decode_tokens
        grammar = self.structured_output.grammar_bitmask(waiting, drafts)
        queued = executor.sample_async(forwarded, grammar)
        return queued, outputs

    def _report(self, step: tuple[SchedulerOutput, Any]) -> EngineCoreOutputs:
        """Wait for a queued step's tokens and turn them into outputs."""
        scheduler_output, queued = step
        return self._update_from_output(scheduler_output, queued.get_output())

    def _update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: Any
    ) -> EngineCoreOutputs:
        start = now_us() if self.tracer is not None else 0.0
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.drafting = bool(runner_output.spec_token_ids)
        if self.tracer is not None:
            self.tracer.update_from_output(start, outputs)
        return outputs

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
        return self.scheduler.reset_prefix_cache()

    def collective_rpc(self, method: str, args: list) -> list[Any]:
        return self.model_executor.collective_rpc(method, tuple(args))

    def get_stats(self) -> dict[str, Any]:
        stats = self.scheduler.make_stats()
        return {f: getattr(stats, f) for f in stats.__struct_fields__}

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        self.model_executor.shutdown()


def fit_max_model_len(config: EngineConfig, num_blocks: int, window: int | None) -> EngineConfig:
    """max_model_len="auto": the longest request the sized KV cache holds (`max_request_len`,
    the same arithmetic as `pagellm plan`), at most the model's length; the config as is
    otherwise. The ready message carries it back to the caller."""
    mc, sc = config.model_config, config.scheduler_config
    if not mc.max_model_len_auto:
        return config
    block_size = config.cache_config.block_size
    length = max_request_len(
        num_blocks, block_size, mc.max_model_len, window, sc.max_num_batched_tokens
    )
    logger.info(
        "max_model_len auto: %d tokens (the KV cache holds %d tokens)",
        length, kv_capacity_tokens(num_blocks, block_size),
    )  # fmt: skip
    return config.with_max_model_len(length)


def _is_empty(step: SchedulerOutput) -> bool:
    return step.total_num_scheduled_tokens == 0


_UTILITIES = {
    "get_num_free_blocks",
    "get_num_kv_blocks",
    "reset_prefix_cache",
    "get_stats",
    "abort_requests",
    "collective_rpc",
    "load_lora",
}
