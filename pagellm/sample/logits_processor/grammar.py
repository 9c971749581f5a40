"""Structured outputs: tokens a request's grammar does not allow this step go to -inf.

The EngineCore fills the step's bitmask rows (`structured_output/manager.py`); they reach
the runner with the step, not with the request, so no row is kept here.
"""

from __future__ import annotations

import torch

from pagellm.sample.logits_processor.interface import LogitsProcessor, SamplingStep
from pagellm.structured_output.bitmask import GrammarBitmask, apply_grammar_bitmask


class GrammarMask(LogitsProcessor):
    masks = True

    def prepare(self, step: SamplingStep) -> tuple[list[str], GrammarBitmask] | None:
        if step.grammar is None:
            return None
        return step.req_ids, step.grammar

    def apply(self, logits: torch.Tensor, args: tuple[list[str], GrammarBitmask]) -> torch.Tensor:
        req_ids, grammar = args
        apply_grammar_bitmask(logits, req_ids, grammar)
        return logits
