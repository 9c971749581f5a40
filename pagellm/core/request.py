"""Request: the scheduler's per-request state, one small object with counters."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagellm.lora.request import LoRARequest
from pagellm.pooling_params import PoolingParams
from pagellm.protocol import EngineCoreRequest, FinishReason
from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagellm.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_GRAMMAR = 1  # its structured-output grammar is being compiled
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """Prompt and output tokens of one sequence and how far the KV cache has caught up.

    Invariant: num_computed_tokens <= num_tokens + num_output_placeholders. A request needs
    compute while num_computed_tokens is below that; it samples when a step brings it there.
    Placeholders are only non-zero under async scheduling (see `pagellm.engine.core`).
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "sampling_params",
        "eos_token_ids",
        "arrival_time",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "block_hashes",
        "stop_reason",
        "num_output_placeholders",
        "prompt_logprobs",
        "priority",
        "structured_output",
        "error",
        "long_rope",
        "spec_token_ids",
        "num_draft_tokens",
        "num_accepted_tokens",
        "pooling_params",
        "lora_request",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: Sequence[int] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)  # any of them ends the request
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # prompt tokens found in the prefix cache at first admission; -1: not yet looked up
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # SamplingParams.prompt_logprobs: rows gathered chunk by chunk, sent with the first token
        self.prompt_logprobs: tuple[list[list[float]], list[list[int]], list[int]] | None = (
            ([], [], []) if sampling_params.prompt_logprobs is not None else None
        )
        self.block_hashes: list[int] = []  # chain hashes of this request's full blocks
        self.stop_reason: int | str | None = None
        # async scheduling: tokens being sampled by a step whose output has not come back
        self.num_output_placeholders = 0
        self.priority = priority  # lower first, with scheduling_policy="priority"
        # its grammar and matcher (pagellm.structured_output), set by the EngineCore
        self.structured_output: StructuredOutputRequest | None = None
        self.error: str | None = None  # why it failed before running (a grammar's compile)
        # a longrope model's long factors rotate all its tokens (pagellm/layers/rope.py)
        self.long_rope = False
        # speculative decoding: drafts proposed for its next step; since arrival, drafts
        # verified and accepted
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # a pooling request: prefill-only, it finishes with its pooled state after its prompt
        self.pooling_params = pooling_params
        self.lora_request = lora_request  # its adapter (None: the base model)

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> Request:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.eos_token_ids,
            req.arrival_time,
            req.priority,
            req.pooling_params,
            req.lora_request,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
