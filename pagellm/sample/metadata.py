"""SamplingMetadata: one step's sampling settings as tensors, one row per sampling request."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagellm.sample.penalties import PenaltyParams


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; rows with temperature 0 are greedy
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [B] float32, 1.0 = off; None when no row uses it
    min_p: torch.Tensor | None  # [B] float32, 0.0 = off; None when no row uses it
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded RNG
    # rows still under min_tokens: (row, token ids that may not be sampled yet)
    banned_tokens: list[tuple[int, list[int]]] = field(default_factory=list)
    # rows with a logit bias: (row, token ids, biases); rows limited to some tokens: (row, ids)
    logit_bias: list[tuple[int, list[int], list[float]]] = field(default_factory=list)
    allowed_tokens: list[tuple[int, list[int]]] = field(default_factory=list)
    max_num_logprobs: int | None = None  # None: no logprobs this step
    penalties: PenaltyParams | None = None  # None when no row has a penalty
