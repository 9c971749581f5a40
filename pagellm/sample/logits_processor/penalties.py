"""Repetition, frequency and presence penalties, with vLLM's and OpenAI's meanings.

For a request with penalties, before temperature and sampling:

- repetition_penalty r (HF / vLLM): every token seen in the prompt or the output so far has
  its logit divided by r if positive, multiplied by r if negative;
- frequency_penalty f (OpenAI): minus f times the token's count in the output so far;
- presence_penalty p (OpenAI): minus p once for every token that appeared in the output.

The settings of each row are kept on the host (`Penalties`); what the penalties need to be
applied lives on the device, one row per InputBatch row (`PenaltyState`):
the output token counts `[rows, vocab]` int32 and the prompt tokens as a `[rows, vocab]` bool
mask. Sampled ids are counted on the device right after sampling, in stream order, so the
next step sees them even when the host has not read them back yet (async scheduling). The
state is allocated when the first request with a penalty arrives. A verify step's row also
counts the drafts before its position (`PenaltyParams.drafts`), and only the tokens kept
(the accepted drafts and the one after them) are recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagellm.sample.logits_processor.interface import LogitsProcessor, NewRow, SamplingStep
from pagellm.utils import to_device


class PenaltyState:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.output_counts = torch.zeros(
            (max_num_reqs, vocab_size), dtype=torch.int32, device=device
        )
        self.prompt_mask = torch.zeros((max_num_reqs, vocab_size), dtype=torch.bool, device=device)

    def add_request(self, row: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """A request took `row`: its prompt, and any output it had before a preemption."""
        device = self.output_counts.device
        self.prompt_mask[row].zero_()
        self.prompt_mask[row, to_device(np.asarray(prompt_ids, np.int64), device)] = True
        self.output_counts[row].zero_()
        if output_ids:
            ids = to_device(np.asarray(output_ids, np.int64), device)
            self.output_counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def record(self, rows: torch.Tensor, sampled: torch.Tensor) -> None:
        """Count this step's samples: `rows [S]` InputBatch rows, `sampled [S]` ids (device;
        -1 for a verify row not kept: it counts 0)."""
        kept = (sampled >= 0).to(torch.int32)
        self.output_counts.index_put_((rows, sampled.clamp(min=0)), kept, accumulate=True)


@dataclass
class PenaltyParams:
    """One step's penalty settings, one entry per sampling row; neutral where unused."""

    state: PenaltyState
    rows: torch.Tensor  # [S] int64 InputBatch rows (indices into the state)
    presence: torch.Tensor  # [S] float32, 0 = off
    frequency: torch.Tensor  # [S] float32, 0 = off
    repetition: torch.Tensor  # [S] float32, 1 = off
    # a verify step: (logits rows, token ids) of the drafts before each row's position,
    # counted as output (the state holds only the tokens known); None: no drafts
    drafts: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits [S, vocab]` -> float32 logits with the penalties applied, in place where
        they are float32 already (neutral values change nothing: x / 1, x * 1 and x - 0 are
        exact)."""
        logits = logits.float()
        counts = self.state.output_counts[self.rows]  # [S, vocab], a copy
        if self.drafts is not None:
            rows, token_ids = self.drafts
            counts.index_put_((rows, token_ids), torch.ones_like(rows, dtype=torch.int32), True)
        in_output = counts > 0
        seen = in_output | self.state.prompt_mask[self.rows]
        r = self.repetition.unsqueeze(1)
        torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits, out=logits)
        logits -= self.frequency.unsqueeze(1) * counts
        logits -= self.presence.unsqueeze(1) * in_output
        return logits

    def record(self, sampled: torch.Tensor) -> None:
        """Count what this step sampled (`sampled [S]`, on the device)."""
        self.state.record(self.rows, sampled)


class Penalties(LogitsProcessor):
    """The three penalties as one processor: they share the device state and one pass."""

    def __init__(self, max_num_reqs: int, vocab_size: int | None, device: torch.device) -> None:
        super().__init__(max_num_reqs, vocab_size, device)
        self.max_num_reqs, self.vocab_size = max_num_reqs, vocab_size
        self.presence = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition = np.ones(max_num_reqs, dtype=np.float32)
        self.state: PenaltyState | None = None  # made for the first request with a penalty

    def add_request(self, row: int, req: NewRow) -> None:
        params = req.params
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.repetition[row] = params.repetition_penalty
        if params.has_penalties:
            self.device_state().add_request(row, req.prompt_token_ids, req.output_token_ids)

    def remove_request(self, row: int) -> None:
        pass  # the row's settings are overwritten by the next request that takes it

    def device_state(self) -> PenaltyState:
        if self.state is None:
            if self.vocab_size is None:
                raise ValueError("penalties need the vocabulary size (InputBatch vocab_size)")
            self.state = PenaltyState(self.max_num_reqs, self.vocab_size, self.device)
        return self.state

    def prepare(self, step: SamplingStep) -> PenaltyParams | None:
        if self.state is None:
            return None
        rows = step.rows
        presence, frequency = self.presence[rows], self.frequency[rows]
        repetition = self.repetition[rows]
        used = (presence != 0) | (frequency != 0) | (repetition != 1)
        if not used.any():
            return None
        device = step.device
        return PenaltyParams(
            state=self.state,
            rows=to_device(rows.astype(np.int64), device),
            presence=to_device(presence, device),
            frequency=to_device(frequency, device),
            repetition=to_device(repetition, device),
            drafts=_drafts_before(step, used, device),
        )

    def neutral(self, num_rows: int) -> PenaltyParams:
        """Neutral penalties over rows [0, num_rows): the most memory they take (profiling)."""
        zeros = torch.zeros(num_rows, device=self.device)
        rows = torch.arange(num_rows, device=self.device)
        return PenaltyParams(self.device_state(), rows, zeros, zeros, zeros + 1.0)

    def apply(self, logits: torch.Tensor, args: PenaltyParams) -> torch.Tensor:
        return args.apply(logits)

    def record(self, args: PenaltyParams, sampled: torch.Tensor) -> None:
        args.record(sampled)  # counted on the device: the next step sees them


def _drafts_before(
    step: SamplingStep, used: np.ndarray, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(logits rows, token ids): each draft before a penalized row's position, or None."""
    if step.drafts_before is None:
        return None
    counts = np.where(used, step.drafts_before, 0)
    if not counts.any():
        return None
    logits_rows = np.repeat(np.arange(len(counts)), counts)
    starts = np.repeat(step.num_tokens[step.rows] - np.cumsum(counts) + counts, counts)
    columns = starts + np.arange(len(logits_rows))  # each row's drafts, left to right
    token_ids = step.token_ids[np.repeat(step.rows, counts), columns]
    return to_device(logits_rows.astype(np.int64), device), to_device(
        token_ids.astype(np.int64), device
    )
