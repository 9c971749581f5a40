"""logit_bias: a request's {token id: bias} added to those logits (OpenAI's and vLLM's)."""

from __future__ import annotations

import numpy as np
import torch

from pagellm.sample.logits_processor.interface import (
    LogitsProcessor,
    NewRow,
    SamplingStep,
    token_ids_tensor,
)
from pagellm.utils import to_device

Bias = tuple[list[int], np.ndarray]  # token ids, float32 biases


class LogitBias(LogitsProcessor):
    def row_settings(self, req: NewRow) -> Bias | None:
        bias = req.params.logit_bias
        if not bias:
            return None
        return list(bias), np.asarray(list(bias.values()), np.float32)

    def prepare(self, step: SamplingStep) -> list[tuple[int, Bias]] | None:
        if not self.rows:
            return None
        rows = self.rows
        biases = [(i, rows[row]) for i, row in enumerate(step.rows.tolist()) if row in rows]
        return biases or None

    def apply(self, logits: torch.Tensor, biases: list[tuple[int, Bias]]) -> torch.Tensor:
        device = logits.device
        for i, (token_ids, values) in biases:
            logits[i, token_ids_tensor(token_ids, device)] += to_device(values, device)
        return logits
