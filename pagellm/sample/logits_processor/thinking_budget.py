"""thinking_token_budget: once a request has thought that many tokens, the reasoning parser's
end tag is forced next (every other logit -inf), one token a step when the tag is several;
then the answer follows as usual.

The thinking is the reasoning parser's span: it opens in the prompt (the chat template ended
it inside an open `<think>`, as DeepSeek-R1's does) or at the start tag's first appearance in
the output, and ends at the end tag's first appearance after it; a later span is not counted
(the server's parsers read only the first one). Tags are token id sequences (the caller
tokenizes them: `SamplingParams.reasoning_tag_ids`).

Where a span stands is a function of the output tokens (`ThinkingSpan`), followed as they
come and rebuilt from them when a preempted request takes a new row. With async scheduling
the output's last token may still be in flight when a step is prepared (its row holds a
placeholder): the span follows it only to decide this step, never for good, and the EngineCore
waits for it (`must_see_last_token`) on the few steps where the decision depends on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagellm.sample.logits_processor.interface import NEG_INF, LogitsProcessor, NewRow, SamplingStep
from pagellm.utils import to_device

WAITING, THINKING, DONE = 0, 1, 2  # before the start tag, inside the span, after its end tag


class ThinkingSpan:
    """One request's thinking span, after its first `num_seen` output tokens."""

    __slots__ = ("budget", "start", "end", "phase", "span_start", "num_seen")

    def __init__(self, budget: int, start: list[int], end: list[int], prompt: Sequence[int]):
        self.budget = budget
        self.start, self.end = start, end
        self.phase = THINKING if opens_in(prompt, start, end) else WAITING
        self.span_start = 0  # the output index of the first thinking token
        self.num_seen = 0

    def follow(self, output: Sequence[int], upto: int) -> None:
        """Take output[num_seen:upto] in, for good."""
        phase, span_start = self.phase, self.span_start
        for stop in range(self.num_seen + 1, upto + 1):
            if phase == DONE:
                break
            phase, span_start = self._after(phase, span_start, output, stop)
        self.phase, self.span_start = phase, span_start
        self.num_seen = max(self.num_seen, upto)

    def _after(self, phase: int, span_start: int, output: Sequence[int], stop: int):
        """(phase, span_start) once output[stop - 1] is in."""
        if phase == WAITING and _ends_with(output, stop, self.start, 0):
            return THINKING, stop
        if phase == THINKING and _ends_with(output, stop, self.end, span_start):
            return DONE, span_start
        return phase, span_start

    def next_forced(self, output: Sequence[int], num_known: int | None = None) -> int | None:
        """The token forced at output index len(output), or None. Only the first
        `num_known - 1` tokens are taken in for good (all but the last by default): the last
        known token may be a placeholder the EngineCore decided not to wait for, and the
        tokens after the known ones are drafts (a verify step) that may be rejected."""
        num_outputs = len(output)
        self.follow(output, (num_outputs if num_known is None else num_known) - 1)
        phase, span_start = self.phase, self.span_start
        for stop in range(self.num_seen + 1, num_outputs + 1):
            if phase == DONE:
                break
            phase, span_start = self._after(phase, span_start, output, stop)
        if phase != THINKING:
            return None
        k = num_outputs - span_start - self.budget  # how much of the end tag is in
        return self.end[k] if 0 <= k < len(self.end) else None

    def must_see_last_token(self, known: Sequence[int], num_unknown: int) -> bool:
        """Whether forcing the next token depends on output tokens not yet known (sampled by a
        step in flight), after the `known` ones: the EngineCore then waits for them."""
        self.follow(known, len(known))
        if num_unknown == 0 or self.phase == DONE:
            return False
        if num_unknown > 1:
            return True
        if self.phase == WAITING:  # the unknown token may open the span: forced at once?
            return self.budget == 0
        # the unknown token may close the span, or be the one that spends the budget
        k = len(known) + 1 - self.span_start - self.budget
        return 0 <= k < len(self.end)


def opens_in(prompt: Sequence[int], start: list[int], end: list[int]) -> bool:
    """Whether the prompt ends inside a thinking span: its last start tag after its last end tag."""
    return _last(prompt, start) > _last(prompt, end)


def _last(ids: Sequence[int], tag: list[int]) -> int:
    """The index of the last occurrence of `tag` in `ids`, or -1 (a long prompt: numpy finds
    where the tag's last token is)."""
    for end in np.flatnonzero(np.asarray(ids, np.int64) == tag[-1])[::-1].tolist():
        if _ends_with(ids, end + 1, tag, 0):
            return end + 1 - len(tag)
    return -1


def _ends_with(ids: Sequence[int], stop: int, tag: list[int], lo: int) -> bool:
    """Whether ids[lo:stop] ends with `tag`."""
    n = len(tag)
    if stop - n < lo or ids[stop - 1] != tag[-1]:
        return False
    return n == 1 or list(ids[stop - n : stop]) == tag


class ThinkingBudget(LogitsProcessor):
    masks = True

    def row_settings(self, req: NewRow) -> ThinkingSpan | None:
        params = req.params
        if params.thinking_token_budget is None or params.reasoning_tag_ids is None:
            return None
        start, end = params.reasoning_tag_ids
        return ThinkingSpan(params.thinking_token_budget, start, end, req.prompt_token_ids)

    def prepare(self, step: SamplingStep) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits rows, the token each must take) of the rows whose budget is spent."""
        if not self.rows:
            return None
        rows, token_ids = [], []
        ends = step.ends().tolist()
        for i, row in enumerate(step.rows.tolist()):
            span = self.rows.get(row)
            if span is None or span.phase == DONE:
                continue
            start = step.num_prompt_tokens[row]
            output = step.token_ids[row, start : ends[i]]  # with a verify step's drafts
            token = span.next_forced(output, step.num_tokens[row] - start)
            if token is not None:
                rows.append(i)
                token_ids.append(token)
        if not rows:
            return None
        return (
            to_device(np.asarray(rows, np.int64), step.device),
            to_device(np.asarray(token_ids, np.int64), step.device),
        )

    def apply(self, logits: torch.Tensor, args: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        rows, token_ids = args
        logits.index_fill_(0, rows, NEG_INF)
        # a finite logit, whatever the model or an earlier mask gave the token
        logits.index_put_((rows, token_ids), logits.new_zeros(()))
        return logits
