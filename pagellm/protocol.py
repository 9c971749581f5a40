"""Messages that cross the EngineCore process boundary, as msgspec structs.

New requests travel in full; outputs carry only the tokens produced since the last
message. Nothing here is pickled: every field is a plain value msgpack can carry.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from pagellm.lora.request import LoRARequest
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2  # aborted by the caller

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]  # the tokenizer's EOS and the generation config's: each ends it
    arrival_time: float
    priority: int = 0  # lower is scheduled first, with scheduling_policy="priority"
    # a pooling model's request (prefill-only: no sampling; `sampling_params` is a placeholder)
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    # per new token: [sampled logprob, then (token id, logprob) of the top `logprobs`]
    new_logprobs: list[list[float]] | None = None
    new_top_logprob_ids: list[list[int]] | None = None
    new_logprob_ranks: list[int] | None = None  # per new token: its rank in the vocabulary
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended the request
    num_cached_tokens: int = 0
    # with the first new token, per prompt token after the first: [its logprob, then the top
    # `prompt_logprobs`] and [its id, then theirs]
    prompt_logprobs: list[list[float]] | None = None
    prompt_logprob_ids: list[list[int]] | None = None
    prompt_logprob_ranks: list[int] | None = None
    error: str | None = None  # the request failed (finish_reason ABORT): why, for the caller
    # speculative decoding: drafts verified for this request this step, and those accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # a pooling request's result (float32 values, native byte order), with its finish
    pooling_output: bytes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_preemptions: int = 0  # since start
    prefix_cache_queries: int = 0  # tokens looked up, since start
    prefix_cache_hits: int = 0  # tokens found, since start
    num_prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits not), since start
    num_generation_tokens: int = 0  # tokens sampled, since start
    # speculative decoding, since start: verify steps of a request with drafts, drafts
    # verified, drafts accepted, and accepted at each draft position (first draft first)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # the reply to a utility call (call_id, result) travels on the output channel too
    utility_output: UtilityOutput | None = None
    trace_events: list[dict[str, Any]] | None = None  # the core's journey trace (tracing.py)


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    failure_message: str | None = None


class EngineCoreRequestType(enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"


class EngineCoreReady(msgspec.Struct, array_like=True, omit_defaults=True):
    """The core's first message: it is up, and how big its KV cache is."""

    num_kv_blocks: int
    max_model_len: int
    pid: int
    cpu_gemm_plan: str | None = None  # the CPU GEMM plan it chose (PAGELLM_CPU_GEMM_PLAN's form)


class EngineCoreOutputType(enum.Enum):
    READY = b"R"  # payload: EngineCoreReady
    OUTPUTS = b"O"  # payload: EngineCoreOutputs
    FAILED = b"F"  # payload: the error message (str); the core exits after sending it
