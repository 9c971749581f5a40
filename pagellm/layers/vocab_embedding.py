"""The vocabulary split over the tensor-parallel ranks: the token embedding and the LM head.

Rank r holds vocabulary rows [r * n, (r + 1) * n) with n = ceil(vocab_size / tp); rows past
the vocabulary are zeros. The embedding looks up the ids in its range (others give zeros)
and one all-reduce sums the ranks' rows; the LM head computes the logits of its rows and
`gather_logits` concatenates them on every rank, cut back to the vocabulary. With one rank
both are the plain layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed.parallel_state import all_gather_last_dim, all_reduce, get_tp_group
from pagellm.layers.linear import ColumnParallelLinear
from pagellm.layers.weights import TensorSlice


def vocab_part(vocab_size: int) -> TensorSlice:
    """The vocabulary rows this rank holds."""
    tp = get_tp_group()
    n = -(-vocab_size // tp.size)
    return TensorSlice(0, tp.rank * n, n)


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding over this rank's vocabulary rows, without random init (see
    `Linear.reset_parameters`)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        part = vocab_part(vocab_size)
        super().__init__(part.size, hidden_size)
        self.part = part
        self.vocab_size = vocab_size
        self.split = get_tp_group().size > 1

    def reset_parameters(self) -> None:
        pass

    def checkpoint_slice(self, param_name: str) -> TensorSlice:
        return self.part

    def full_shape(self, param_name: str) -> tuple[int, ...]:
        return (self.vocab_size, self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        if not self.split:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.part.start
        outside = (local < 0) | (local >= self.part.size)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(ColumnParallelLinear):
    """The untied LM head: this rank's vocabulary rows of `lm_head.weight`; the logits it
    returns are this rank's columns (`gather_logits` joins them)."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size, bias=False, part=vocab_part(vocab_size))


def gather_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, vocab / tp] on every rank -> [N, vocab] on every rank."""
    if get_tp_group().size == 1:
        return logits
    return all_gather_last_dim(logits)[:, :vocab_size]
