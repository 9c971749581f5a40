"""LogitsProcessor: one sampling feature behind one small interface (vLLM v1's
`sample/logits_processor/`, for rows that never move).

A processor lives as long as the runner's `InputBatch`. It keeps what each request needs
by the request's row (`add_request` / `remove_request`), and once a step turns that into
the step's arguments on the host (`prepare`: None when no row of the step uses it, so a
step without the feature does no work). The Sampler then calls `apply` on the step's
logits, in the registry's order (`pagellm/sample/logits_processor/__init__.py`):

- masks (`masks = True`) set logits to -inf in place, in the model's dtype; the logprobs
  are taken after them;
- the others come after the logprobs are taken, on a float32 copy the Sampler makes once
  (they may write into it) and return the logits to use next.

Invariants: `prepare` makes no device sync (host values go over with `to_device`); logits
row i is the request in `step.rows[i]`; values a processor leaves alone stay bit for bit.
A step that verifies drafts (speculative decoding) has several logits rows of one request,
one a position: a processor that reads the tokens before a position takes them up to
`step.ends()[i]` (the row's tokens, then the drafts before that position: `token_ids` holds
them after the row's tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from pagellm.sampling_params import SamplingParams
from pagellm.structured_output.bitmask import GrammarBitmask
from pagellm.utils import to_device

NEG_INF = float("-inf")


class NewRow(NamedTuple):
    """What a processor may keep of a request that takes a row."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # outputs before a preemption: a resumed request has some
    eos_token_ids: tuple[int, ...]


@dataclass(slots=True)
class SamplingStep:
    """What a processor may read to prepare one step (host arrays, read, never written)."""

    rows: np.ndarray  # [S] InputBatch rows: logits row i is the request in rows[i]
    token_ids: np.ndarray  # [max_reqs, max_model_len + 1] each row's prompt, then output ids
    num_tokens: np.ndarray  # [max_reqs] prompt + output tokens of each row
    num_prompt_tokens: np.ndarray  # [max_reqs]
    device: torch.device
    req_ids: list[str] | None = None  # [S] the requests of the logits rows
    grammar: GrammarBitmask | None = None  # this step's structured-output masks
    # [S] drafts before each logits row's position (a verify step); None: no drafts
    drafts_before: np.ndarray | None = None

    def ends(self) -> np.ndarray:
        """[S] how many tokens come before each logits row's position: its row's tokens and,
        in a verify step, the drafts before it (in `token_ids` after the row's tokens)."""
        ends = self.num_tokens[self.rows]
        return ends if self.drafts_before is None else ends + self.drafts_before


class LogitsProcessor:
    """One sampling feature. Subclasses keep per-row settings through `row_settings` (or
    override `add_request` / `remove_request`) and implement `prepare` and `apply`."""

    masks = False  # True: sets logits to -inf in place; the logprobs see it

    def __init__(self, max_num_reqs: int, vocab_size: int | None, device: torch.device) -> None:
        self.device = device
        self.rows: dict[int, Any] = {}  # row -> its settings, for the rows that use this

    def row_settings(self, req: NewRow) -> Any | None:
        """What to keep for a request, or None if it does not use this feature."""
        return None

    def add_request(self, row: int, req: NewRow) -> None:
        settings = self.row_settings(req)
        if settings is None:
            self.rows.pop(row, None)
        else:
            self.rows[row] = settings

    def remove_request(self, row: int) -> None:
        self.rows.pop(row, None)

    def prepare(self, step: SamplingStep) -> Any | None:
        """This step's arguments for `apply`, or None: nothing to do this step."""
        raise NotImplementedError

    def apply(self, logits: torch.Tensor, args: Any) -> torch.Tensor:
        """`logits [S, vocab]` -> the logits to use next (the same tensor when in place)."""
        raise NotImplementedError

    def record(self, args: Any, sampled: torch.Tensor) -> None:
        """After sampling: `sampled [S]` ids on the device (for state kept on the device);
        -1 where a verify step's row was not kept (past the request's accepted drafts)."""


def ban(logits: torch.Tensor, bans: list[tuple[int, list[int]]]) -> torch.Tensor:
    """logits[i, ids] = -inf for each (logits row i, token ids); in place."""
    for i, token_ids in bans:
        logits[i, token_ids_tensor(token_ids, logits.device)] = NEG_INF
    return logits


def token_ids_tensor(token_ids: list[int], device: torch.device) -> torch.Tensor:
    # a Python list as an index would be copied to a GPU with a stream sync
    return to_device(np.asarray(token_ids, np.int64), device)
