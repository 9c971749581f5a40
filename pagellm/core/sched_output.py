"""What the scheduler tells the model runner each step, and what the runner answers.

Plain dataclasses: both sides live in the EngineCore process. New requests come in full,
requests the runner already holds as diffs (new blocks, computed-token count). The runner
keeps each request's token list itself and appends what it samples; it samples for a
request iff `num_computed_tokens + num_scheduled_tokens == len(prompt) + len(outputs)` (plus
its drafts: a request verifying k drafts samples 1 to k + 1 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.lora.request import LoRARequest
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after a preemption."""

    req_id: str
    prompt_token_ids: list[int]  # shared with the scheduler's Request: read-only
    output_token_ids: list[int]  # tokens generated before a preemption, else []
    sampling_params: SamplingParams
    block_ids: list[int]  # all its blocks, in order
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hit)
    eos_token_ids: tuple[int, ...] = ()  # the sampler bans them (and stop ids) before min_tokens
    long_rope: bool = False  # rotated with a longrope model's long factors (its second rows)
    pooling_params: PoolingParams | None = None  # a pooling request (no sampling)
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)


@dataclass
class CachedRequestData:
    """Requests the runner already holds, as diffs; the i-th entry of each list is one request."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # appended this step (often [])
    # its blocks after this step's allocation (fewer than before when blocks held for rejected
    # drafts went back to the pool: the runner's row drops its last ones)
    num_blocks: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step's tokens


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int
    # finished, aborted or preempted since the last step: the runner drops them first,
    # then adds scheduled_new_reqs (a preempted request may come back under the same id)
    finished_req_ids: set[str]
    # speculative decoding: req_id -> the draft ids this step verifies after the request's
    # last token (they are among its num_scheduled_tokens)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # per req_ids entry; [] when the step did not reach the end of its tokens (partial prefill)
    sampled_token_ids: list[list[int]]
    # per request, per sampled token (several with speculative decoding): [its logprob, then
    # the top-k logprobs] when requested, else []
    logprobs: list[list[list[float]]] | None = None
    logprob_token_ids: list[list[list[int]]] | None = None  # [sampled id, then top-k ids]
    logprob_ranks: list[list[int]] | None = None  # per sampled token: its vocab rank
    # req_id -> (first prompt position of the chunk, then per position as in logprobs,
    # logprob_token_ids and logprob_ranks)
    prompt_logprobs: dict[str, tuple[int, list[list[float]], list[list[int]], list[int]]] | None = (
        None
    )
    # speculative decoding: req_id -> drafts proposed for its next step (after these tokens)
    spec_token_ids: dict[str, list[int]] | None = None
    # pooling requests whose prompt this step finished: req_id -> pooled values (float32 bytes)
    pooler_output: dict[str, bytes] | None = None
