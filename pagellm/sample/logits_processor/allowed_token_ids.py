"""allowed_token_ids: a request samples only among these ids (the others go to -inf)."""

from __future__ import annotations

import torch

from pagellm.sample.logits_processor.interface import (
    NEG_INF,
    LogitsProcessor,
    NewRow,
    SamplingStep,
    token_ids_tensor,
)


class AllowedTokenIds(LogitsProcessor):
    def row_settings(self, req: NewRow) -> list[int] | None:
        return req.params.allowed_token_ids or None

    def prepare(self, step: SamplingStep) -> list[tuple[int, list[int]]] | None:
        if not self.rows:
            return None
        rows = self.rows
        allowed = [(i, rows[row]) for i, row in enumerate(step.rows.tolist()) if row in rows]
        return allowed or None

    def apply(self, logits: torch.Tensor, allowed: list[tuple[int, list[int]]]) -> torch.Tensor:
        for i, token_ids in allowed:
            ids = token_ids_tensor(token_ids, logits.device)
            keep = logits[i, ids]
            logits[i] = NEG_INF
            logits[i, ids] = keep
        return logits
