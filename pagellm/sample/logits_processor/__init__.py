"""The sampling features, one logits processor each (`interface.py`), in the order the
Sampler applies them: the masks first (the logprobs are taken after them; a spent thinking
budget's forced end tag last of them), then the rest on a float32 copy, as vLLM orders
them: allowed ids, logit bias, penalties.

A new feature is a file here with its `LogitsProcessor` subclass and a line in `PROCESSORS`.
"""

from __future__ import annotations

import torch

from pagellm.sample.logits_processor.allowed_token_ids import AllowedTokenIds
from pagellm.sample.logits_processor.bad_words import BadWords
from pagellm.sample.logits_processor.grammar import GrammarMask
from pagellm.sample.logits_processor.interface import LogitsProcessor, NewRow, SamplingStep
from pagellm.sample.logits_processor.logit_bias import LogitBias
from pagellm.sample.logits_processor.min_tokens import MinTokens
from pagellm.sample.logits_processor.penalties import Penalties
from pagellm.sample.logits_processor.thinking_budget import ThinkingBudget

PROCESSORS: list[type[LogitsProcessor]] = [
    GrammarMask,
    MinTokens,
    BadWords,
    ThinkingBudget,  # after the bans: a forced end tag wins over them
    AllowedTokenIds,
    LogitBias,
    Penalties,
]

__all__ = ["PROCESSORS", "LogitsProcessor", "NewRow", "SamplingStep", "build_logits_processors"]


def build_logits_processors(
    max_num_reqs: int,
    vocab_size: int | None,
    device: torch.device,
    classes: list[type[LogitsProcessor]] | None = None,
) -> list[LogitsProcessor]:
    """One processor of each class (`PROCESSORS` by default), in order; masks come first."""
    classes = PROCESSORS if classes is None else classes
    kinds = [cls.masks for cls in classes]
    if kinds != sorted(kinds, reverse=True):
        raise ValueError("logits processors: every mask (masks = True) must come first")
    return [cls(max_num_reqs, vocab_size, device) for cls in classes]
