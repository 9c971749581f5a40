"""Scheduler: continuous batching under a token budget, chunked prefill, preemption.

There are no prefill and decode phases. Every step lets each request's computed tokens
catch up with its tokens (prompt + outputs), spending `max_num_batched_tokens` tokens over
at most `max_num_seqs` requests:

1. running requests, oldest first, each taking what it still needs or what is left of
   the budget (a long prompt is prefilled in chunks over several steps);
2. a running request that cannot get KV blocks preempts the most recently admitted one
   (maybe itself): its blocks are freed and it waits at the front of the queue, to be
   recomputed (mostly from the prefix cache) when admitted again;
3. waiting requests in FIFO order (or by (priority, arrival) with the "priority" policy), if
   nothing was preempted, each starting after its longest cached prefix; admission stops at
   the first that cannot get blocks.

A request with a structured-output constraint waits apart (WAITING_FOR_GRAMMAR, no blocks)
until its grammar is compiled, then joins the queue; its matcher follows every token appended,
and the request stops when the grammar has terminated.

`num_computed_tokens` advances as soon as a request is scheduled; `update_from_output`
appends the sampled tokens and decides who stops.

With `async_scheduling` the next step is scheduled before the last one's tokens are back:
a step that samples for a request adds an output placeholder, so the request is scheduled
for one more token (its id reaches the runner on the device), and `update_from_output`
replaces the placeholder with the token. A request is not scheduled past the token that
samples its last possible output (max_tokens, max_model_len); one that stops on EOS or a stop
token costs one wasted token, whose output is dropped.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagellm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sampled import (
    append_tokens,
    error_output,
    gather_prompt_logprobs,
    sampled_output,
)
from pagellm.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagellm.core.spec_decode import SpecDecodeStats, drafts_in_step, take_proposal
from pagellm.lora.request import fits_lora_slots
from pagellm.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats

logger = logging.getLogger(__name__)


@dataclass
class _Step:
    """One schedule() call: the token budget left and what has been scheduled so far."""

    token_budget: int
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # drafts verified
    preempted: bool = False


class Scheduler:
    """Owns the waiting queue, the running list and the KV cache manager."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        log_stats: bool = True,
        async_scheduling: bool = False,
        sliding_window: int | None = None,  # every layer's window is at most this (None: no)
        policy: str = "fcfs",
        long_rope_switch: int | None = None,  # longrope: past this many tokens, long factors
        speculative: SpeculativeConfig | None = None,  # drafts come with the runner's outputs
        max_loras: int = 0,  # distinct adapters among running requests (0: no LoRA)
    ) -> None:
        self.max_loras = max_loras
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.chunked_prefill = scheduler_config.enable_chunked_prefill  # False: an encoder's
        self.kv_cache_manager = KVCacheManager(
            cache_config.block_size,
            num_kv_blocks,
            self.max_model_len,
            cache_config.enable_prefix_caching,
            sliding_window,
        )
        # a request stops at max_model_len tokens, or earlier if the whole cache holds fewer
        self.max_request_len = self.kv_cache_manager.max_request_len(self.max_num_batched_tokens)
        self.log_stats = log_stats
        self.async_scheduling = async_scheduling
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()  # WAITING or PREEMPTED, in admission order
        self.running: list[Request] = []  # RUNNING, oldest admission first
        self.waiting_for_grammar: list[Request] = []  # WAITING_FOR_GRAMMAR, by arrival
        self.policy = policy  # "fcfs" | "priority": the waiting queue's order
        self.finished_req_ids: set[str] = set()  # for the next SchedulerOutput
        self.finished_on_arrival: list[Request] = []  # prompts too long: reported next update
        self.num_preemptions = 0
        self.long_rope_switch = long_rope_switch
        self.num_prompt_tokens = 0  # computed, since start (stats)
        self.num_generation_tokens = 0  # sampled, since start (stats)
        self.spec_stats = (
            None if speculative is None else SpecDecodeStats(speculative.num_speculative_tokens)
        )
        # no drafts verified while more requests than this run (vLLM's disable_by_batch_size)
        self.spec_max_batch = None if speculative is None else speculative.disable_by_batch_size
        # slots a running request holds past its scheduled tokens: a draft model writes the
        # K/V of its drafts there after the step (`num_lookahead_slots`)
        self.num_lookahead_tokens = 0 if speculative is None else speculative.num_lookahead_tokens

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request. A prompt over `max_request_len` (possible only when the KV cache
        holds fewer than max_model_len tokens) finishes at the next update: LENGTH, no tokens."""
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if self._needs_long_rope(request, request.num_tokens):
            request.long_rope = True
        if request.num_prompt_tokens > self.max_request_len:
            request.status = RequestStatus.FINISHED_LENGTH
            self.finished_on_arrival.append(request)
        elif request.structured_output is not None:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(request)
        else:
            self._enqueue(request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Into the waiting queue: at the back (fcfs; the front for a preempted request), or
        by (priority, arrival time)."""
        if self.policy == "priority":
            key = (request.priority, request.arrival_time)
            after = (i for i, r in enumerate(self.waiting) if (r.priority, r.arrival_time) > key)
            self.waiting.insert(next(after, len(self.waiting)), request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _check_grammars(self) -> None:
        """Queue the requests whose grammar is compiled; fail those whose grammar failed."""
        if not self.waiting_for_grammar:
            return
        still = []
        for request in self.waiting_for_grammar:
            so = request.structured_output
            if not so.poll():
                still.append(request)
            elif so.error is not None:
                request.status = RequestStatus.FINISHED_ABORTED
                request.error = so.error
                self.finished_on_arrival.append(request)
            else:
                request.status = RequestStatus.WAITING
                self._enqueue(request)
        self.waiting_for_grammar = still

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string); unknown ids are ignored."""
        if not status.finished:
            raise ValueError(f"{status.name} is not a finished status")
        ids = (request_ids,) if isinstance(request_ids, str) else request_ids
        requests = [self.requests[i] for i in ids if i in self.requests]
        for request in requests:
            request.status = status
            self._release(request)
        if requests:
            self.running = [r for r in self.running if not r.is_finished]
            self.waiting = deque(r for r in self.waiting if not r.is_finished)
            self.waiting_for_grammar = [r for r in self.waiting_for_grammar if not r.is_finished]

    def _release(self, request: Request) -> None:
        """Free a finished request's blocks and forget it; the runner hears at the next step.
        A grammar it still waited for is let go (a queued compile nobody waits for is
        cancelled)."""
        if request.structured_output is not None:
            request.structured_output.release()
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # ---- schedule ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _Step(self.max_num_batched_tokens)
        self._check_grammars()
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
        output = SchedulerOutput(
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached_reqs,
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - step.token_budget,
            finished_req_ids=self.finished_req_ids,
            scheduled_spec_decode_tokens=step.spec_tokens,
        )
        self.finished_req_ids = set()
        return output

    def _schedule_running(self, step: _Step) -> None:
        i = 0  # requests after i are younger: preemption victims come from there
        drafts_on = self.spec_max_batch is None or len(self.running) <= self.spec_max_batch
        while i < len(self.running) and step.token_budget > 0:
            request = self.running[i]
            if not drafts_on:
                request.spec_token_ids = []
            num_new = self._num_new_tokens(request, request.num_computed_tokens, step)
            if num_new == 0:  # async: its last useful token is already in flight
                i += 1
                continue
            if self._needs_long_rope(request, request.num_computed_tokens + num_new):
                self._switch_to_long_rope(self.running.pop(i), step)
                continue
            new_block_ids, num_new = self._allocate(request, num_new, step)
            if new_block_ids is None:
                return  # it preempted itself, the last running request
            cached = step.cached_reqs
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(new_block_ids)
            cached.num_blocks.append(self.kv_cache_manager.num_blocks(request.request_id))
            cached.num_computed_tokens.append(request.num_computed_tokens)
            drafts = drafts_in_step(request, num_new)
            if drafts:
                step.spec_tokens[request.request_id] = drafts
            self._advance(request, num_new, step)
            i += 1

    def _allocate(
        self, request: Request, num_new: int, step: _Step
    ) -> tuple[list[int] | None, int]:
        """Blocks for the request's `num_new` next tokens, and for its drafts after them
        where free blocks allow without preempting anyone: (new block ids, tokens)."""
        if request.spec_token_ids:
            num_drafts = len(request.spec_token_ids)
            num_all = self._num_new_tokens(request, request.num_computed_tokens, step, num_drafts)
            if self.long_rope_switch is not None and not request.long_rope:
                # drafts past the switch would be verified with the short factors
                num_all = min(num_all, self.long_rope_switch - request.num_computed_tokens)
            if num_all > num_new:
                lookahead = self._num_lookahead_slots(
                    request, request.num_computed_tokens + num_all
                )
                new_block_ids = self.kv_cache_manager.allocate_slots(
                    request, num_all, num_lookahead_tokens=lookahead
                )
                if new_block_ids is not None:
                    return new_block_ids, num_all
        return self._allocate_or_preempt(request, num_new, step), num_new

    def _num_lookahead_slots(self, request: Request, num_total: int) -> int:
        """Slots past the request's first `num_total` tokens that a draft model may write:
        `num_lookahead_tokens`, none at or past the last worth computing (so a request alone
        always fits the cache)."""
        if not self.num_lookahead_tokens:
            return 0
        last = self._max_computed_tokens(request)
        return max(0, min(num_total + self.num_lookahead_tokens, last) - num_total)

    def _allocate_or_preempt(self, request: Request, num_new: int, step: _Step) -> list[int] | None:
        """Blocks for `num_new` more tokens (and the lookahead slots after them), preempting
        the youngest running requests until they fit. None if `request` itself had to go."""
        lookahead = self._num_lookahead_slots(request, request.num_computed_tokens + num_new)
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request, num_new, num_lookahead_tokens=lookahead
            )
            if new_block_ids is not None:
                return new_block_ids
            victim = self.running.pop()
            self._preempt(victim)
            step.preempted = True
            if victim is request:
                return None

    def _needs_long_rope(self, request: Request, num_tokens: int) -> bool:
        """Whether computing the request's first `num_tokens` turns it to longrope's long
        factors (HF: a sequence of more than original_max_position_embeddings tokens)."""
        switch = self.long_rope_switch
        return switch is not None and not request.long_rope and num_tokens > switch

    def _switch_to_long_rope(self, request: Request, step: _Step) -> None:
        """Its cached tokens were rotated with the short factors: recompute them all with the
        long ones, as HF's Phi-3 `generate` does at this step (a preemption, without a victim
        of memory), their blocks keyed apart from the short ones."""
        self._recompute_later(request)
        request.long_rope = True
        request.block_hashes = []
        step.preempted = True

    def _preempt(self, request: Request) -> None:
        self._recompute_later(request)
        request.num_preemptions += 1
        self.num_preemptions += 1

    def _recompute_later(self, request: Request) -> None:
        """Free the request's blocks; it waits at the front to compute its tokens again."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        self._enqueue(request, front=True)
        self.finished_req_ids.add(request.request_id)  # the runner drops its state

    def _schedule_waiting(self, step: _Step) -> None:
        skipped: list[Request] = []  # their adapter needs a slot no running adapter frees yet
        while self.waiting and step.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not fits_lora_slots(request.lora_request, self.running, self.max_loras):
                skipped.append(self.waiting.popleft())  # others may go first, as in vLLM
                continue
            if not self._try_admit(request, step):
                break  # FIFO: nobody overtakes a request waiting for blocks
            self.waiting.popleft()
            self.running.append(request)
        self.waiting.extendleft(reversed(skipped))  # back in their places, at the front

    def _try_admit(self, request: Request, step: _Step) -> bool:
        kv = self.kv_cache_manager
        computed_blocks, num_computed = kv.get_computed_blocks(request)
        num_new = self._num_new_tokens(request, num_computed, step)
        if not self.chunked_prefill and num_computed + num_new < request.num_tokens:
            return False  # its prompt in one step (the budget holds max_model_len): wait
        lookahead = self._num_lookahead_slots(request, num_computed + num_new)
        if kv.allocate_slots(request, num_new, computed_blocks, lookahead) is None:
            return False
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:  # first admission, not a resume
            request.num_cached_tokens = num_computed
        new_req = NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=kv.get_block_ids(request.request_id),
            num_computed_tokens=num_computed,
            eos_token_ids=request.eos_token_ids,
            long_rope=request.long_rope,
            pooling_params=request.pooling_params,
            lora_request=request.lora_request,
        )
        step.new_reqs.append(new_req)
        self._advance(request, num_new, step)
        return True

    def _num_new_tokens(
        self, request: Request, num_computed: int, step: _Step, num_drafts: int = 0
    ) -> int:
        """Tokens still to compute (its drafts after them), capped by the budget and by the
        request's length limit."""
        num_tokens = request.num_tokens + request.num_output_placeholders + num_drafts
        num_left = min(num_tokens, self._max_computed_tokens(request)) - num_computed
        return min(num_left, step.token_budget)

    def _max_computed_tokens(self, request: Request) -> int:
        """Tokens worth computing: up to the one that samples the last possible output."""
        max_tokens = request.sampling_params.max_tokens
        prompt = request.num_prompt_tokens
        last = self.max_request_len if max_tokens is None else prompt + max_tokens
        return max(min(last, self.max_request_len) - 1, prompt)

    def _advance(self, request: Request, num_new: int, step: _Step) -> None:
        step.num_scheduled_tokens[request.request_id] = num_new
        step.token_budget -= num_new
        prompt_left = request.num_prompt_tokens - request.num_computed_tokens
        self.num_prompt_tokens += min(max(prompt_left, 0), num_new)
        request.num_computed_tokens += num_new
        if not self.async_scheduling:
            return
        if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1  # this step samples it

    # ---- outputs -------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append sampled tokens, finish requests that stop, free their blocks."""
        mro = model_runner_output
        outputs = self._report_finished_on_arrival()
        if mro.prompt_logprobs:
            gather_prompt_logprobs(self.requests, mro.prompt_logprobs)
        if mro.pooler_output:
            outputs += self._finish_pooled(mro.pooler_output)
        for i, (req_id, token_ids) in enumerate(zip(mro.req_ids, mro.sampled_token_ids)):
            request = self.requests.get(req_id)
            # no token: a partial prefill; no request: finished since it was scheduled.
            # A request preempted since (async scheduling) keeps its token.
            if not token_ids or request is None:
                continue
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            self.num_generation_tokens += len(token_ids)
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, ())
            try:
                output = self._process_sampled(request, token_ids, mro, i)
                if drafts:
                    self.spec_stats.verified(request, output, len(drafts), len(token_ids))
                take_proposal(request, mro.spec_token_ids)
                outputs.append(output)
            except Exception as e:  # this request's own fault: it alone fails
                outputs.append(self.fail_request(request, e))
        if any(output.finished for output in outputs):
            self.running = [r for r in self.running if not r.is_finished]
            self.waiting = deque(r for r in self.waiting if not r.is_finished)
        stats = self.make_stats() if self.log_stats else None
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.monotonic())

    def _finish_pooled(self, pooled: dict[str, bytes]) -> list[EngineCoreOutput]:
        """Pooling requests whose prompt is computed: finished with their vector, blocks freed."""
        outputs = []
        for req_id, values in pooled.items():
            request = self.requests.get(req_id)
            if request is None:  # aborted since it was scheduled
                continue
            request.status = RequestStatus.FINISHED_STOPPED
            self._release(request)
            outputs.append(
                EngineCoreOutput(req_id, [], finish_reason=FinishReason.STOP,
                                 num_cached_tokens=max(request.num_cached_tokens, 0),
                                 pooling_output=values)
            )  # fmt: skip
        return outputs

    def fail_request(self, request: Request, error: Exception) -> EngineCoreOutput:
        """Finish a request that raised while its tokens were processed; free its blocks."""
        if isinstance(error, ValueError):  # the request's own input, said in words
            logger.warning("request %r failed: %s", request.request_id, error)
        else:  # anything else is a bug: its traceback
            logger.exception("request %r failed; the others carry on", request.request_id)
        request.status = RequestStatus.FINISHED_ABORTED
        if self.requests.get(request.request_id) is request:
            self._release(request)
        return error_output(request.request_id, error)

    def _report_finished_on_arrival(self) -> list[EngineCoreOutput]:
        outputs = []
        for request in self.finished_on_arrival:
            if self.requests.get(request.request_id) is request:  # not aborted meanwhile
                self._release(request)
                reason, error = request.status.finish_reason, request.error
                outputs.append(
                    EngineCoreOutput(request.request_id, [], finish_reason=reason, error=error)
                )
        self.finished_on_arrival.clear()
        return outputs

    def _process_sampled(
        self, request: Request, token_ids: list[int], mro: ModelRunnerOutput, i: int
    ) -> EngineCoreOutput:
        new_token_ids = append_tokens(request, token_ids, self.max_request_len)
        if request.is_finished:
            self._release(request)
        return sampled_output(request, new_token_ids, mro, i)

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.waiting_for_grammar),
            kv_cache_usage=kv.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            **(self.spec_stats.fields() if self.spec_stats is not None else {}),
        )
