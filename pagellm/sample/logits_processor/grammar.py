"""Structured outputs: tokens a request's grammar does not allow this step go to -inf.

The EngineCore fills the step's bitmask rows (`structured_output/manager.py`); they reach
the runner with the step, not with the request, so no row is kept here. In a verify step a
request has a mask for each position its grammar constrains, keyed by the drafts before it.
"""

from __future__ import annotations

import torch

from pagellm.sample.logits_processor.interface import LogitsProcessor, SamplingStep
from pagellm.structured_output.bitmask import GrammarBitmask, apply_grammar_bitmask


class GrammarMask(LogitsProcessor):
    masks = True

    def prepare(self, step: SamplingStep) -> tuple[list[tuple[str, int]], GrammarBitmask] | None:
        """(each logits row's request and drafts before its position, the step's masks)."""
        if step.grammar is None:
            return None
        before = [0] * len(step.rows) if step.drafts_before is None else step.drafts_before.tolist()
        return list(zip(step.req_ids, before)), step.grammar

    def apply(self, logits: torch.Tensor, args: tuple[list, GrammarBitmask]) -> torch.Tensor:
        keys, grammar = args
        apply_grammar_bitmask(logits, keys, grammar)
        return logits
