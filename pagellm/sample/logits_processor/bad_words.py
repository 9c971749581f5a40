"""bad_words: a bad word's last token is banned where the output so far ends with the rest
of it (the words as token id sequences: `SamplingParams.bad_words_token_ids`, filled by the
input processor). The output's last token must be on the host: the engine waits for it.
In a verify step a position's output so far takes in the drafts before it."""

from __future__ import annotations

import torch

from pagellm.sample.logits_processor.interface import LogitsProcessor, NewRow, SamplingStep, ban


class BadWords(LogitsProcessor):
    masks = True

    def row_settings(self, req: NewRow) -> list[list[int]] | None:
        return req.params.bad_words_token_ids or None

    def prepare(self, step: SamplingStep) -> list[tuple[int, list[int]]] | None:
        if not self.rows:
            return None
        bans = []
        ends = step.ends().tolist()
        for i, row in enumerate(step.rows.tolist()):
            words = self.rows.get(row)
            if words is None:
                continue
            start, end = step.num_prompt_tokens[row], ends[i]
            ids = [
                seq[-1]
                for seq in words
                if len(seq) - 1 <= end - start
                and step.token_ids[row, end - len(seq) + 1 : end].tolist() == seq[:-1]
            ]
            if ids:
                bans.append((i, ids))
        return bans or None

    def apply(self, logits: torch.Tensor, bans: list[tuple[int, list[int]]]) -> torch.Tensor:
        return ban(logits, bans)
