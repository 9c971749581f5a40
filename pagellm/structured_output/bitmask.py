"""One step's grammar bitmask and its application to the logits on the device.

The EngineCore fills a bitmask row on the host for every constrained request that samples
this step (in a verify step, one for each position of its drafts the grammar constrains);
the runner copies the rows to the device without a sync and sets the logits of disallowed
tokens to -inf before sampling. Rows of unconstrained requests are not touched,
and a step without constrained rows does none of this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagellm.utils import to_device

_NEG_INF = float("-inf")


# how a bitmask crosses to tensor-parallel ranks:
# (req_ids, drafts before each row's position, the int32 words' bytes, words a row)
GrammarBitmaskWire = tuple[list[str], list[int], bytes, int]


@dataclass
class GrammarBitmask:
    req_ids: list[str]  # the constrained requests that sample this step, a row each
    bitmask: np.ndarray  # [len(req_ids), ceil(vocab / 32)] int32; bit j of word i: token 32i+j
    # a verify step's rows: the drafts before the row's position (a request has a row per
    # position its grammar constrains); empty: every row is its request's next token
    drafts_before: list[int] = field(default_factory=list)

    def keys(self) -> list[tuple[str, int]]:
        """(request, drafts before the position) of each bitmask row."""
        return list(zip(self.req_ids, self.drafts_before or [0] * len(self.req_ids)))

    def to_wire(self) -> GrammarBitmaskWire:
        data = np.ascontiguousarray(self.bitmask).tobytes()
        return self.req_ids, self.drafts_before, data, self.bitmask.shape[1]

    @classmethod
    def from_wire(cls, wire: GrammarBitmaskWire) -> GrammarBitmask:
        req_ids, drafts_before, data, words = wire
        bitmask = np.frombuffer(data, np.int32).reshape(len(req_ids), words)
        return cls(list(req_ids), bitmask, list(drafts_before))


def apply_grammar_bitmask(
    logits: torch.Tensor, keys: list[tuple[str, int]], grammar: GrammarBitmask
) -> None:
    """Mask `logits` [S, V] in place; `keys` [S] names each logits row's request and the
    drafts before its position (0 but in a verify step)."""
    position = {key: i for i, key in enumerate(keys)}
    grammar_keys = grammar.keys()
    keep = [k for k, key in enumerate(grammar_keys) if key in position]
    if not keep:
        return
    rows = np.fromiter((position[grammar_keys[k]] for k in keep), np.int64, len(keep))
    bitmask = grammar.bitmask if len(keep) == len(grammar.req_ids) else grammar.bitmask[keep]
    device = logits.device
    apply_token_bitmask(logits, to_device(bitmask, device), to_device(rows, device))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits[rows[k], t] = -inf where bit t of bitmask[k] is 0.

    logits: [S, V]; bitmask: [K, W] int32 with 32 W >= V; rows: [K] int64, distinct."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [K, W, 32]
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab].bool()  # [K, V]
    masked = logits.index_select(0, rows).masked_fill_(~allowed, _NEG_INF)
    logits.index_copy_(0, rows, masked)
