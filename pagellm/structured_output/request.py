"""StructuredOutputRequest: one request's grammar, from its compile to its last token.

Invariant: the matcher has seen exactly the request's first `num_seen` output tokens, and
before a bitmask is filled `sync()` brings `num_seen` to the number of output tokens (tokens
are never taken back today, preemption keeps them; a rollback or a replay covers the case).
With a reasoning parser, tokens up to the end of the thinking are not the grammar's. Drafts
(speculative decoding) are followed only to fill their positions' masks and rolled back:
the matcher takes a token for good once it is accepted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from pagellm.config import StructuredOutputsConfig
from pagellm.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class StructuredOutputRequest:
    __slots__ = (
        "params", "future", "matcher", "error", "num_seen", "num_matched",
        "reasoning_end_id", "reasoning_ended", "ended_in_prompt", "deadline", "timeout_error",
        "on_release", "max_matcher_s", "over_budget",
    )  # fmt: skip

    def __init__(
        self,
        params: StructuredOutputsParams,
        future: Future,
        prompt_token_ids: list[int] | None = None,
        deadline: float = float("inf"),
        timeout_error: str = "",
        on_release: Callable[[], None] | None = None,
        max_matcher_s: float = float("inf"),
    ) -> None:
        self.params = params
        # -> (CompiledGrammar, (think start, think end) ids or None), or raises ValueError
        self.future = future
        self.deadline = deadline  # time.monotonic() past which the compile has failed
        self.timeout_error = timeout_error  # what the request fails with then
        self.on_release = on_release  # called once, when the request no longer waits
        self.matcher: Any = None  # xgrammar.GrammarMatcher once compiled
        self.error: str | None = None
        self.num_seen = 0  # output tokens looked at
        self.num_matched = 0  # of those, tokens the matcher accepted (after the thinking)
        self.reasoning_end_id: int | None = None
        self.ended_in_prompt: Any = prompt_token_ids  # the prompt, until poll() decides
        self.reasoning_ended = True
        # CPU seconds one matcher call (a bitmask, an accept) may take: past them, the request
        # fails at its next token (`over_budget` says why) instead of stalling every step
        self.max_matcher_s = max_matcher_s
        self.over_budget: str | None = None

    def poll(self) -> bool:
        """True once compiled (the matcher is made) or failed (`error` says why): the compile
        raised, or it was not done by the deadline (it is let go: `release`)."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.future.done():
            if time.monotonic() < self.deadline:
                return False
            self.error = self.timeout_error
            self.release()
            return True
        if self.future.cancelled():  # not while it waits: see StructuredOutputManager
            self.error = "its grammar's compile was cancelled"
            return True
        error = self.future.exception()
        if isinstance(error, ValueError):  # in our words: the constraint's fault
            self.error = str(error)
            return True
        if error is not None:  # ours: logged, not echoed
            logger.error("a grammar failed to compile", exc_info=error)
            self.error = "its grammar failed to compile (an internal error, logged)"
            return True
        import xgrammar as xgr  # already imported by the compile thread

        compiled, reasoning_ids = self.future.result()
        self.matcher = xgr.GrammarMatcher(compiled)
        self.set_reasoning(reasoning_ids)
        return True

    def set_reasoning(self, reasoning_ids: tuple[int, int] | None) -> None:
        """With a reasoning parser the grammar starts after the thinking's end token; a prompt
        that closed its thinking (enable_thinking=False) starts with it."""
        prompt, self.ended_in_prompt = self.ended_in_prompt, True
        if reasoning_ids is not None:
            self.reasoning_end_id = reasoning_ids[1]
            self.ended_in_prompt = _closed(prompt, *reasoning_ids)
        self.reasoning_ended = self.ended_in_prompt

    def release(self) -> None:
        """The request no longer waits for its grammar (it finished, or timed out)."""
        on_release, self.on_release = self.on_release, None
        if on_release is not None:
            on_release()

    @property
    def constrains_next(self) -> bool:
        """Whether the next token is constrained (thinking over, grammar not yet done)."""
        return self.reasoning_ended and not self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Follow one sampled output token; True if the request must stop here: the grammar
        has terminated, or it refused the token (which a mask should have prevented).
        ValueError if following its grammar has cost more than its budget (the request fails
        alone)."""
        self.num_seen += 1
        if self.over_budget is not None:
            raise ValueError(self.over_budget)
        if not self.reasoning_ended:
            self.reasoning_ended = token_id == self.reasoning_end_id
            return False
        if self.matcher.is_terminated():
            return True
        start = time.thread_time()
        accepted = self.matcher.accept_token(token_id)
        self._charge(start, "accept a token")
        if self.over_budget is not None:
            raise ValueError(self.over_budget)
        if not accepted:  # the mask left no token: another constraint excludes what it allows
            raise ValueError(
                "the output constraint allows no token here that allowed_token_ids, bad_words "
                "and min_tokens leave (the request cannot go on)"
            )
        self.num_matched += 1
        return self.matcher.is_terminated()

    def _charge(self, start: float, what: str) -> None:
        """Note a matcher call past the budget (CPU time: a loaded machine does not count)."""
        spent = time.thread_time() - start
        if spent > self.max_matcher_s and self.over_budget is None:
            self.over_budget = (
                f"its grammar took {1e3 * spent:.0f} ms of CPU to {what}, over the limit "
                f"max_matcher_ms={1e3 * self.max_matcher_s:g} (an ambiguous grammar costs more "
                f"with every token; {StructuredOutputsConfig.how_to_raise('max_matcher_ms')})"
            )

    def sync(self, output_token_ids: list[int]) -> None:
        """Make the matcher follow exactly `output_token_ids` (a rollback, or a replay)."""
        if self.num_seen == len(output_token_ids):
            return
        if self.num_seen > len(output_token_ids):  # tokens were taken back
            self.matcher.reset()
            self.num_seen = self.num_matched = 0
            self.reasoning_ended = self.ended_in_prompt
        for token_id in output_token_ids[self.num_seen :]:
            self.accept(token_id)

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Fill `bitmask[row]` with the tokens allowed next; False when every token is."""
        start = time.thread_time()
        restricts = self.matcher.fill_next_token_bitmask(bitmask, row)
        self._charge(start, "mask the next token")
        return restricts

    # ---- drafts (speculative decoding): followed for a moment, never for good ----------

    def fill_positions(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> list[int]:
        """A verify step's masks, from `bitmask[row]` on: one for the next token and one
        after each draft the grammar takes (a draft it refuses is rejected by its position's
        mask, so the positions after it need none). The positions filled, as the number of
        drafts before each; rows where every token is allowed are not kept."""
        filled: list[int] = []

        def at(j: int) -> None:
            if self.fill(bitmask, row + len(filled)):
                filled.append(j)

        self._walk(drafts, at)
        return filled

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The drafts up to the first one the grammar refuses (the rest would be rejected)."""
        return drafts[: self._walk(drafts)]

    def _walk(self, drafts: list[int], at: Callable[[int], None] | None = None) -> int:
        """Follow `drafts` after the tokens seen, calling `at(j)` at each position j the
        grammar constrains; the matcher is rolled back after. How many drafts it took."""
        ended, taken, j = self.reasoning_ended, 0, 0
        try:
            for j in range(len(drafts) + 1):
                constrained = ended and not self.matcher.is_terminated()
                if at is not None and constrained:
                    at(j)
                if j == len(drafts):
                    break
                if not ended:
                    ended = drafts[j] == self.reasoning_end_id
                    continue
                if not constrained:
                    break
                start = time.thread_time()
                accepted = self.matcher.accept_token(drafts[j])
                self._charge(start, "accept a token")
                if not accepted:
                    break
                taken += 1
        finally:
            if taken:
                self.matcher.rollback(taken)
        return j


def _closed(token_ids: list[int] | None, start_id: int, end_id: int) -> bool:
    """Whether the last thinking span of `token_ids` is closed (or there is none open)."""
    ids = token_ids or []
    last = {start_id: -1, end_id: -1}
    for i, t in enumerate(ids):
        if t in last:
            last[t] = i
    return last[end_id] > last[start_id]
