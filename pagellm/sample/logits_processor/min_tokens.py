"""min_tokens: every EOS id and the stop token ids are banned until a request has that many
output tokens (also with ignore_eos: vLLM's `_all_stop_token_ids`, HF's min_new_tokens)."""

from __future__ import annotations

import torch

from pagellm.sample.logits_processor.interface import LogitsProcessor, NewRow, SamplingStep, ban


class MinTokens(LogitsProcessor):
    masks = True

    def row_settings(self, req: NewRow) -> tuple[int, list[int]] | None:
        params = req.params
        if not params.min_tokens:
            return None
        return params.min_tokens, [*req.eos_token_ids, *params.stop_token_ids]

    def prepare(self, step: SamplingStep) -> list[tuple[int, list[int]]] | None:
        """(logits row, ids) of the rows still under their min_tokens."""
        if not self.rows:
            return None
        rows = step.rows
        num_outputs = step.ends() - step.num_prompt_tokens[rows]
        bans = []
        for i, row in enumerate(rows.tolist()):
            settings = self.rows.get(row)
            if settings is not None and num_outputs[i] < settings[0]:
                bans.append((i, settings[1]))
        return bans or None

    def apply(self, logits: torch.Tensor, bans: list[tuple[int, list[int]]]) -> torch.Tensor:
        return ban(logits, bans)
