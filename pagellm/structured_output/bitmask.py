"""One step's grammar bitmask and its application to the logits on the device.

The EngineCore fills a bitmask row on the host for every constrained request that samples
this step; the runner copies the rows to the device without a sync and sets the logits of
disallowed tokens to -inf before sampling. Rows of unconstrained requests are not touched,
and a step without constrained rows does none of this.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagellm.utils import to_device

_NEG_INF = float("-inf")


# how a bitmask crosses to tensor-parallel ranks: (req_ids, the int32 words' bytes, words a row)
GrammarBitmaskWire = tuple[list[str], bytes, int]


@dataclass
class GrammarBitmask:
    req_ids: list[str]  # the constrained requests that sample this step
    bitmask: np.ndarray  # [len(req_ids), ceil(vocab / 32)] int32; bit j of word i: token 32i+j

    def to_wire(self) -> GrammarBitmaskWire:
        return self.req_ids, np.ascontiguousarray(self.bitmask).tobytes(), self.bitmask.shape[1]

    @classmethod
    def from_wire(cls, wire: GrammarBitmaskWire) -> GrammarBitmask:
        req_ids, data, words = wire
        return cls(list(req_ids), np.frombuffer(data, np.int32).reshape(len(req_ids), words))


def apply_grammar_bitmask(
    logits: torch.Tensor, req_ids: list[str], grammar: GrammarBitmask
) -> None:
    """Mask `logits` [S, V] in place; `req_ids` [S] names each logits row's request."""
    position = {req_id: i for i, req_id in enumerate(req_ids)}
    keep = [k for k, req_id in enumerate(grammar.req_ids) if req_id in position]
    if not keep:
        return
    rows = np.fromiter((position[grammar.req_ids[k]] for k in keep), np.int64, len(keep))
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
