"""OutputProcessor: EngineCoreOutputs -> RequestOutputs, on the caller side.

Per request it keeps the prompt, the generated token ids and an incremental detokenizer;
it checks stop strings (a request stopped by one must be aborted in the core) and builds
RequestOutput objects as each request's `output_kind` asks. Requests with n > 1 are fanned
out into n child requests and gathered back into one RequestOutput here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import torch

from pagellm.engine.core_client import EngineDeadError
from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pagellm.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagellm.sampling_params import INT64_MIN, RequestOutputKind
from pagellm.tracing import CallerTracer, now_us

logger = logging.getLogger(__name__)


class ParentRequest:
    """The user's request when n > 1: collects the children's completions into one output."""

    __slots__ = (
        "request_id", "child_ids", "completions", "num_finished", "n", "output_kind",
        "sent_prompt_logprobs", "num_cached_tokens",
    )  # fmt: skip

    def __init__(self, request_id: str, n: int, output_kind: RequestOutputKind) -> None:
        self.request_id = request_id
        self.child_ids = [f"{i}_{request_id}" for i in range(n)]
        self.n = n
        self.output_kind = output_kind
        self.completions: list[CompletionOutput | None] = [None] * n
        self.num_finished = 0
        self.sent_prompt_logprobs = False  # DELTA: the first child's carry them, no other
        # the fewest prompt tokens a child found cached (a later child may hit the blocks of
        # an earlier one: the request's own prompt, not the cache it came to)
        self.num_cached_tokens: int | None = None


def fan_out(
    request: EngineCoreRequest,
) -> list[tuple[EngineCoreRequest, ParentRequest | None, int]]:
    """A request with n > 1 becomes n children "{i}_{id}" (seeds seed + i, wrapped into int64 so
    that every valid seed gives valid children); else itself."""
    params = request.sampling_params
    if params.n == 1:
        return [(request, None, 0)]
    parent = ParentRequest(request.request_id, params.n, params.output_kind)
    children = []
    for i in range(params.n):
        child_params = msgspec.structs.replace(params, n=1)
        if params.seed is not None:
            child_params.seed = (params.seed + i - INT64_MIN) % 2**64 + INT64_MIN
        child = msgspec.structs.replace(
            request, request_id=parent.child_ids[i], sampling_params=child_params
        )
        children.append((child, parent, i))
    return children


class RequestState:
    __slots__ = (
        "request_id",
        "index",
        "parent",
        "prompt",
        "prompt_token_ids",
        "lora_request",
        "params",
        "detokenizer",
        "token_ids",
        "logprobs",
        "cumulative_logprob",
        "prompt_logprobs",
        "metrics",
        "num_cached_tokens",
        "sent_tokens",
        "sent_chars",
        "queue",
    )

    def __init__(self, prompt: str | None, request: EngineCoreRequest, tokenizer: Any) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.index = 0
        self.parent: ParentRequest | None = None
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.lora_request = request.lora_request
        self.params = params
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params)
            if tokenizer is not None and request.pooling_params is None
            else None
        )
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = None  # arrives with the first token
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)
        self.num_cached_tokens = 0
        self.sent_tokens = 0  # for DELTA outputs: what the caller has already been given
        self.sent_chars = 0
        self.queue: Any = None  # AsyncLLM puts this request's outputs here


class OutputProcessor:
    def __init__(self, tokenizer: Any | None, tracer: CallerTracer | None = None) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}  # n > 1: the user's request id -> parent
        self.tracer = tracer  # the journey trace's caller side (None: off)

    @contextmanager
    def adding(
        self,
        prompt: str | None,
        request: EngineCoreRequest,
        abort: Callable[[list[str]], Any],
        queue: Any = None,
    ) -> Iterator[list[EngineCoreRequest]]:
        """Register a request (n > 1: its n children, `fan_out`) and yield what the engine
        core must be sent. All or nothing: if registering or the sending in the `with` body
        fails, what was registered is forgotten and aborted in the core (`abort`)."""
        added: list[EngineCoreRequest] = []
        try:
            for child, parent, index in fan_out(request):
                self.add_request(prompt, child, parent, index, queue)
                added.append(child)
            yield added
        except BaseException:
            self.withdraw([child.request_id for child in added], abort)
            raise

    def add_request(
        self,
        prompt: str | None,
        request: EngineCoreRequest,
        parent: ParentRequest | None = None,
        index: int = 0,
        queue: Any = None,
    ) -> None:
        if request.request_id in self.request_states:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        state = RequestState(prompt, request, self.tokenizer)
        state.parent, state.index, state.queue = parent, index, queue
        self.request_states[request.request_id] = state
        if parent is not None:
            self.parents[parent.request_id] = parent

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forgets these requests (a parent's id: its children); returns the ids the engine
        core still has to abort."""
        ids = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            ids += parent.child_ids if parent is not None else [rid]
        return [rid for rid in ids if self.request_states.pop(rid, None) is not None]

    def withdraw(self, request_ids: list[str], abort: Callable[[list[str]], Any]) -> None:
        """Undo a request added in part (all or nothing): forget the children registered so
        far and abort them in the core (a dead core has nothing left to abort)."""
        try:
            abort(self.abort_requests(request_ids))
        except EngineDeadError:
            pass

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs to hand out and the request ids stopped by a stop string.
        A request the core failed raises ValueError in its queue (AsyncLLM), or here after
        the other outputs are handled (LLMEngine: the caller aborts the rest)."""
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        errors: list[str] = []
        now = time.time()
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted by the caller, or stopped by a string a step ago
            if out.error is not None:
                self._fail(state, out.error, errors)
                continue
            try:
                request_output = self._process_output(state, out, now, reqs_to_abort)
            except Exception as e:  # this request's own fault (detokenizing it...): it alone fails
                logger.exception("request %r: its outputs cannot be processed", out.request_id)
                if not out.finished:
                    reqs_to_abort.append(out.request_id)
                self._fail(state, f"{type(e).__name__}: {e}", errors)
                continue
            if request_output is None:
                continue
            if state.queue is not None:
                state.queue.put_nowait(request_output)
            else:
                request_outputs.append(request_output)
        if errors:
            raise ValueError(errors[0])
        return request_outputs, reqs_to_abort

    def _process_output(
        self, state: RequestState, out: EngineCoreOutput, now: float, reqs_to_abort: list[str]
    ) -> RequestOutput | PoolingRequestOutput | None:
        if out.pooling_output is not None:  # a pooling request: done in one output
            del self.request_states[out.request_id]
            return pooling_output(state.request_id, state.prompt, state.prompt_token_ids, out)
        finish_reason, stop_reason = self._update(state, out, now)
        if finish_reason is not None:
            del self.request_states[out.request_id]
            if not out.finished:
                reqs_to_abort.append(out.request_id)
        output = self._make_request_output(state, finish_reason, stop_reason)
        if self.tracer is not None:
            finished = finish_reason is not None
            self.tracer.request_output(state.request_id, finished, output, state.metrics)
        return output

    def _fail(self, state: RequestState, error: str, errors: list[str]) -> None:
        self.request_states.pop(state.request_id, None)
        request_id = state.parent.request_id if state.parent else state.request_id
        message = f"request {request_id!r} failed: {error}"
        if state.queue is not None:
            state.queue.put_nowait(ValueError(message))
        else:
            errors.append(message)

    def _update(
        self, state: RequestState, out: EngineCoreOutput, now: float
    ) -> tuple[FinishReason | None, int | str | None]:
        new_ids = out.new_token_ids
        state.token_ids.extend(new_ids)
        if state.metrics.first_token_time is None and new_ids:
            state.metrics.first_token_time = now
            state.num_cached_tokens = out.num_cached_tokens
            parent, cached = state.parent, out.num_cached_tokens
            if parent is not None:
                known = parent.num_cached_tokens
                parent.num_cached_tokens = cached if known is None else min(known, cached)
        state.metrics.last_token_time = now
        if out.num_draft_tokens:
            state.metrics.num_draft_tokens += out.num_draft_tokens
            state.metrics.num_accepted_tokens += out.num_accepted_tokens
        if out.new_logprobs is not None and state.logprobs is not None:
            self._update_logprobs(state, out)
        if out.prompt_logprobs is not None:
            entries = map(
                _logprob_entry,
                out.prompt_logprobs,
                out.prompt_logprob_ids,
                out.prompt_logprob_ranks,
            )
            state.prompt_logprobs = [None, *entries]  # nothing precedes the first token
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if state.detokenizer is not None:
            start = now_us() if self.tracer is not None else 0.0
            stop_string = self._detokenize(state, new_ids, finish_reason)
            if self.tracer is not None:
                self.tracer.detokenize(start, state.request_id, len(new_ids), stop_string)
            if stop_string is not None:  # it ends the text, even of a request at its length
                finish_reason, stop_reason = FinishReason.STOP, stop_string
        if finish_reason is not None:
            state.metrics.finished_time = now
        return finish_reason, stop_reason

    def _detokenize(
        self, state: RequestState, new_ids: list[int], finish_reason: FinishReason | None
    ) -> str | None:
        # an EOS or stop token id that ended the request is not part of the text
        if finish_reason == FinishReason.STOP and not state.params.include_stop_str_in_output:
            new_ids = new_ids[:-1]
        return state.detokenizer.update(new_ids)

    def _update_logprobs(self, state: RequestState, out: EngineCoreOutput) -> None:
        for values, ids, rank in zip(
            out.new_logprobs, out.new_top_logprob_ids, out.new_logprob_ranks
        ):
            state.logprobs.append(_logprob_entry(values, ids, rank))
            state.cumulative_logprob += values[0]

    def _make_request_output(
        self, state: RequestState, finish_reason: FinishReason | None, stop_reason: Any
    ) -> RequestOutput | None:
        finished = finish_reason is not None
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completion = self._completion(state, finish_reason, stop_reason, kind)
        if state.parent is not None:
            return self._parent_output(state, completion, finished)
        return self._request_output(state, state.request_id, [completion], finished)

    def _completion(
        self, state: RequestState, finish_reason: Any, stop_reason: Any, kind: RequestOutputKind
    ) -> CompletionOutput:
        finished = finish_reason is not None
        text = state.detokenizer.output_text(finished) if state.detokenizer else ""
        token_ids, logprobs = state.token_ids, state.logprobs
        if kind == RequestOutputKind.DELTA:
            text, token_ids = text[state.sent_chars :], token_ids[state.sent_tokens :]
            if logprobs is not None:
                logprobs = logprobs[state.sent_tokens :]
            state.sent_chars += len(text)
            state.sent_tokens += len(token_ids)
        return CompletionOutput(
            index=state.index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason,
        )

    def _parent_output(
        self, state: RequestState, completion: CompletionOutput, finished: bool
    ) -> RequestOutput | None:
        parent = state.parent
        parent.completions[state.index] = completion
        parent.num_finished += finished
        all_done = parent.num_finished == parent.n
        if all_done:
            self.parents.pop(parent.request_id, None)
        if parent.output_kind == RequestOutputKind.FINAL_ONLY and not all_done:
            return None
        if parent.output_kind == RequestOutputKind.DELTA:
            completions = [completion]
        else:
            completions = [c for c in parent.completions if c is not None]
        return self._request_output(state, parent.request_id, completions, all_done)

    def _request_output(
        self, state: RequestState, request_id: str, completions: list, finished: bool
    ) -> RequestOutput:
        prompt_logprobs = state.prompt_logprobs
        if state.params.output_kind == RequestOutputKind.DELTA:
            state.prompt_logprobs = None  # deltas carry them once, for all n children
            parent = state.parent
            if parent is not None and prompt_logprobs is not None:
                if parent.sent_prompt_logprobs:
                    prompt_logprobs = None
                parent.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=_num_cached_tokens(state),
            metrics=state.metrics,
            prompt_logprobs=prompt_logprobs,
            lora_request=state.lora_request,
        )


def pooling_output(
    request_id: str, prompt: str | None, prompt_token_ids: list[int], out: EngineCoreOutput
) -> PoolingRequestOutput:
    """The core's float32 bytes as vLLM's `PoolingRequestOutput` (a tensor in `.outputs.data`)."""
    data = torch.frombuffer(bytearray(out.pooling_output), dtype=torch.float32)
    return PoolingRequestOutput(request_id, PoolingOutput(data), prompt_token_ids, True, prompt,
                                out.num_cached_tokens)  # fmt: skip


def _num_cached_tokens(state: RequestState) -> int:
    parent = state.parent
    if parent is None or parent.num_cached_tokens is None:
        return state.num_cached_tokens
    return parent.num_cached_tokens


def _logprob_entry(values: list[float], ids: list[int], rank: int) -> dict[int, Logprob]:
    """{token: Logprob} from [its logprob, then the top k], [its id, then theirs] and its
    rank in the vocabulary (tokens at least as likely); the top k are ranked 1 .. k, and a
    token among them takes its top-k rank, as in vLLM (so the likeliest token is rank 1 even
    when another ties with it)."""
    top = ids[1:]  # best first
    entry = {ids[0]: Logprob(values[0], rank=rank)}
    for rank, (tid, val) in enumerate(zip(top, values[1:]), start=1):
        entry[tid] = Logprob(val, rank=rank)
    return entry
