"""SamplingMetadata: one step's sampling settings as tensors, one row per sampling request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagellm.sample.logits_processor.interface import LogitsProcessor


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; rows with temperature 0 are greedy
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [B] float32, 1.0 = off; None when no row uses it
    min_p: torch.Tensor | None  # [B] float32, 0.0 = off; None when no row uses it
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded RNG
    max_num_logprobs: int | None = None  # None: no logprobs this step
    # the logits processors with work this step, in order, each with its arguments
    processors: list[tuple[LogitsProcessor, Any]] = field(default_factory=list)

    def record(self, sampled: torch.Tensor) -> None:
        """Tell the processors what this step sampled (`sampled [B]`, on the device)."""
        for proc, args in self.processors:
            proc.record(args, sampled)
