"""StructuredOutputManager: the EngineCore's grammars, compiled off the step loop.

A constrained request gets its grammar from a compile cache keyed by the canonical
constraint (`StructuredOutputsParams.key()`); a miss is compiled in a small thread pool (the
first compile also loads the tokenizer and builds the vocabulary tables: xgrammar's
`TokenizerInfo`). Meanwhile the request waits in the scheduler as WAITING_FOR_GRAMMAR, holding
no blocks, and everything else runs. A constraint that fails to compile fails its request, as
does one not compiled within `compile_timeout_s` (a thread cannot be stopped: the compile
finishes into the cache; the limits checked before it, `validator.checked_grammar`, keep it
short). A compile still queued when no request waits for it any more (aborted, timed out) is
cancelled.

Each step, `sampling_requests()` names the scheduled requests that sample and whose sampling
reads their last token on the host (a grammar's matcher, a multi-token bad word, a thinking
budget whose end tag may be forced this step: `ThinkingSpan.must_see_last_token`), and
`grammar_bitmask()` fills one bitmask row per constrained one (`bitmask.py` applies them).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from pagellm.config import REASONING_TAGS, StructuredOutputsConfig
from pagellm.sample.logits_processor.thinking_budget import ThinkingSpan
from pagellm.structured_output.bitmask import GrammarBitmask
from pagellm.structured_output.limits import limit_message
from pagellm.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from pagellm.config import ModelConfig
    from pagellm.core.request import Request
    from pagellm.core.sched_output import SchedulerOutput
    from pagellm.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

CACHE_SIZE = 512  # compiled grammars kept (each holds token-mask tables: ~100 KB to a few MB)
_IDLE_WAIT_S = 0.02  # an idle step waits this long for a compile before looking again


class StructuredOutputManager:
    def __init__(
        self,
        model_config: ModelConfig,
        max_num_seqs: int,
        async_scheduling: bool = False,
        reasoning_parser: str | None = None,
        limits: StructuredOutputsConfig | None = None,
    ) -> None:
        self.model_config = model_config
        self.limits = limits or StructuredOutputsConfig()
        self.max_num_seqs = max_num_seqs
        # async: a step that samples for a request has already counted its placeholder
        self.placeholder = int(async_scheduling)
        self.reasoning_parser = reasoning_parser  # constraints start after the thinking
        self.executor = ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="pagellm-grammar"
        )
        self._backend: Any = None
        self._backend_error: Exception | None = None
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._waiters: dict[Future, int] = {}  # unfinished compiles -> requests waiting
        # unfinished requests whose sampling reads their last token on the host, by id
        self.live: dict[str, Request] = {}
        # unfinished requests with a thinking budget: those read it near its end, by id
        self.budgets: dict[str, tuple[Request, ThinkingSpan]] = {}
        self._bitmask: torch.Tensor | None = None  # [max_num_seqs, words] int32, host

    # ---- requests in ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        constraint = params.structured_outputs
        if constraint is not None:
            request.structured_output = self._wait_for(constraint, request.prompt_token_ids)
        if constraint is not None or any(len(seq) > 1 for seq in params.bad_words_token_ids or ()):
            self.live[request.request_id] = request
        budget, tags = params.thinking_token_budget, params.reasoning_tag_ids
        if budget is not None and tags is not None:
            span = ThinkingSpan(budget, *tags, request.prompt_token_ids)
            self.budgets[request.request_id] = (request, span)

    def _wait_for(
        self, constraint: StructuredOutputsParams, prompt_token_ids: list[int]
    ) -> StructuredOutputRequest:
        """A request's grammar: its compile, the deadline for it, and a release that cancels
        a queued compile once no request waits for it."""
        key = constraint.key()
        future = self.compile(key)
        if not future.done():
            self._waiters[future] = self._waiters.get(future, 0) + 1
        timeout = self.limits.compile_timeout_s
        return StructuredOutputRequest(
            constraint,
            future,
            prompt_token_ids,
            deadline=time.monotonic() + timeout,
            timeout_error=limit_message(
                f"its grammar did not compile within {timeout:g} s",
                "compile_timeout_s",
                self.limits,
            ),
            on_release=functools.partial(self._stop_waiting, key, future),
            max_matcher_s=self.limits.max_matcher_ms / 1e3,
        )

    def _stop_waiting(self, key: tuple[str, str], future: Future) -> None:
        waiting = self._waiters.pop(future, 0) - 1
        if waiting > 0:
            self._waiters[future] = waiting
        elif waiting == 0 and future.cancel() and self._cache.get(key) is future:
            del self._cache[key]  # not started: a later request compiles it anew

    def compile(self, key: tuple[str, str]) -> Future:
        """The compiled grammar of `key`, from the cache or a worker thread."""
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        future = self.executor.submit(self._compile_now, key)
        self._cache[key] = future
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _compile_now(self, key: tuple[str, str]) -> tuple[Any, tuple[int, int] | None]:
        from pagellm.structured_output.validator import checked_grammar

        start = time.perf_counter()
        backend = self._get_backend()
        compiled = backend.compile(key, checked_grammar(key, self.limits))
        elapsed_ms = 1e3 * (time.perf_counter() - start)
        logger.debug("compiled a %s grammar in %.1f ms", key[0], elapsed_ms)
        return compiled, backend.reasoning_ids

    def _get_backend(self) -> Any:
        with self._backend_lock:
            if self._backend is None and self._backend_error is None:
                try:
                    self._backend = _make_backend(self.model_config, self.reasoning_parser)
                except ValueError as e:  # ours: what the model lacks
                    self._backend_error = e
                except Exception:  # not the user's to read
                    logger.exception("the grammar backend failed to start")
                    self._backend_error = ValueError("its grammar backend failed to start")
            if self._backend_error is not None:
                raise ValueError(f"structured outputs are unavailable: {self._backend_error}")
            return self._backend

    def warm_up(self) -> None:
        """Build the backend now in a compile thread, so that the first constrained request
        does not wait for it; a failure is kept and reported to that request."""
        self.executor.submit(self._warm_up)

    def _warm_up(self) -> None:
        with contextlib.suppress(ValueError):
            self._get_backend()

    def wait_for_compiles(self, futures: list[Future]) -> None:
        """Nothing else to run: block briefly until one of these compiles finishes."""
        concurrent.futures.wait(futures, _IDLE_WAIT_S, concurrent.futures.FIRST_COMPLETED)

    # ---- one step ------------------------------------------------------------------------

    def sampling_requests(self, sched: SchedulerOutput) -> list[Request]:
        """The requests of `sched` that sample and need their last token on the host first."""
        scheduled = sched.num_scheduled_tokens
        drafts = sched.scheduled_spec_decode_tokens
        waiting = []
        if self.live:
            self.live = {rid: r for rid, r in self.live.items() if not r.is_finished}
            waiting = [
                r
                for rid, r in self.live.items()
                if rid in scheduled and self._samples(r, len(drafts.get(rid, ())))
            ]
        if self.budgets:
            self.budgets = {rid: b for rid, b in self.budgets.items() if not b[0].is_finished}
            for rid, (r, span) in self.budgets.items():
                if (
                    rid in scheduled
                    and rid not in self.live
                    and self._samples(r, len(drafts.get(rid, ())))
                ):
                    unknown = r.num_output_placeholders - self._own_placeholder(rid, drafts)
                    if span.must_see_last_token(r.output_token_ids, unknown):
                        waiting.append(r)
        return waiting

    def _samples(self, request: Request, num_drafts: int = 0) -> bool:
        """Whether the step just scheduled brings the request to the end of its tokens (and
        of the `num_drafts` drafts it verifies)."""
        own = 0 if num_drafts else self.placeholder
        end = request.num_tokens + request.num_output_placeholders - own
        return request.num_computed_tokens == end + num_drafts

    def _own_placeholder(self, req_id: str, drafts: dict[str, list[int]]) -> int:
        """The placeholder the step just scheduled counted for the request: one under async
        scheduling, none for a verify step (its tokens are counted once they are back)."""
        return 0 if drafts.get(req_id) else self.placeholder

    def grammar_bitmask(
        self, requests: list[Request], drafts: dict[str, list[int]] | None = None
    ) -> GrammarBitmask | None:
        """One row per request whose next token the grammar constrains (its last token must be
        on the host, in `output_token_ids`), and in a verify step one for each position after
        its `drafts` that the grammar constrains; None when no row restricts anything."""
        requests = [
            r
            for r in requests
            if r.structured_output is not None
            and r.structured_output.matcher is not None
            and not r.is_finished
        ]
        if not requests:  # bad words, thinking budgets: no grammar, no backend
            return None
        drafts = drafts or {}
        num_rows = len(requests) + sum(len(drafts.get(r.request_id, ())) for r in requests)
        bitmask = self._bitmask_buffer(num_rows)
        req_ids: list[str] = []
        drafts_before: list[int] = []
        for request in requests:
            so = request.structured_output
            so.sync(request.output_token_ids)
            for j in so.fill_positions(bitmask, len(req_ids), drafts.get(request.request_id, [])):
                req_ids.append(request.request_id)
                drafts_before.append(j)
        if not req_ids:
            return None
        rows = bitmask[: len(req_ids)].numpy()
        return GrammarBitmask(req_ids, rows, drafts_before if any(drafts_before) else [])

    def _bitmask_buffer(self, num_rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            rows = max(num_rows, self.max_num_seqs)
            self._bitmask = self._get_backend().allocate_bitmask(rows)
        return self._bitmask

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def _make_backend(model_config: ModelConfig, reasoning_parser: str | None) -> Any:
    from pagellm.loader import load_tokenizer
    from pagellm.structured_output.backend import XgrammarBackend, stop_token_ids, tokenizer_info

    start = time.perf_counter()
    tokenizer = load_tokenizer(model_config.source)
    if tokenizer is None:
        raise ValueError(f"the model {model_config.model!r} has no tokenizer (pass tokenizer=...)")
    stop_ids = stop_token_ids(model_config, tokenizer.eos_token_id)
    backend = XgrammarBackend(tokenizer_info(tokenizer, model_config.vocab_size, stop_ids))
    if reasoning_parser is not None:
        backend.reasoning_ids = reasoning_token_ids(tokenizer, reasoning_parser)
    logger.info("grammar backend (xgrammar) ready in %.1f s", time.perf_counter() - start)
    return backend


def reasoning_token_ids(tokenizer: Any, reasoning_parser: str) -> tuple[int, int]:
    """The ids of the parser's start and end tags (<think>, </think>), each one token: a
    grammar starts after the end tag. gpt-oss's harmony tags are several tokens (its answer
    starts after a channel header): not followed yet, said so."""
    tags = REASONING_TAGS.get(reasoning_parser, ("<think>", "</think>"))
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tags]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(
            f"reasoning_parser {reasoning_parser!r} needs its tags {tags[0]} and {tags[1]} as "
            "single tokens of the vocabulary (a grammar starts after the thinking's end)"
        )
    return ids[0], ids[1]
