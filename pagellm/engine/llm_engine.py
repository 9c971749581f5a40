"""LLMEngine: the caller side of the engine.

`add_request()` tokenizes and validates a prompt, registers its output state and hands it to
the engine core; `step()` only consumes what the core already produced: it detokenizes,
checks stop strings, aborts requests a stop string ended, and returns RequestOutputs.
"""

from __future__ import annotations

import logging
from typing import Any

from pagellm.config import EngineConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core_client import EngineCoreClient, start_engine
from pagellm.engine.input_processor import InputProcessor, PromptType
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.stat_logger import StatLogger
from pagellm.lora.request import LoRARequest
from pagellm.outputs import RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.protocol import SchedulerStats
from pagellm.sampling_params import SamplingParams
from pagellm.tracing import CallerTracer, now_us

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, tokenizer: Any | None, engine_core: EngineCoreClient
    ) -> None:
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
        self.last_stats: SchedulerStats | None = None
        self.stat_logger = StatLogger(config.log_stats_interval, config.device)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(*start_engine(engine_args))

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this model was loaded without a tokenizer")
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validates and submits a request; raises ValueError before anything is queued."""
        tracer = self.tracer
        start = now_us() if tracer is not None else 0.0
        prompt_text, request = self.input_processor.process_inputs(
            request_id, prompt, params, arrival_time, priority, lora_request
        )
        if tracer is not None:
            tracer.input_processing(start, request)
        core = self.engine_core
        with self.output_processor.adding(prompt_text, request, core.abort_requests) as children:
            for child in children:
                start = now_us() if tracer is not None else 0.0
                core.add_request(child)
                if tracer is not None:
                    tracer.zmq_send(start, child.request_id)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids))

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.get_output()
        if self.tracer is not None:
            self.tracer.output_received(outputs)
        if outputs.scheduler_stats is not None:
            self.last_stats = outputs.scheduler_stats
            self.stat_logger.record(outputs.scheduler_stats)
        request_outputs, reqs_to_abort = self.output_processor.process_outputs(outputs.outputs)
        self.engine_core.abort_requests(reqs_to_abort)
        return request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.engine_core.call_utility(method, *args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
        if self.tracer is not None:
            self.tracer.write(self.config.trace)
