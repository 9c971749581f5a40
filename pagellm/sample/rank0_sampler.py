"""Sampling under tensor parallelism: rank 0 samples, every rank gets its ids.

Every rank holds the same full logits (the LM head gathers them), but only rank 0 draws:
random rows, per-request generators and logprobs live there alone. One broadcast of the
[B] sampled ids, on the device (no host sync), gives every rank the tokens its next step
feeds back, so the ranks' batches never drift apart.
"""

from __future__ import annotations

import torch

from pagellm.distributed.parallel_state import broadcast_from_rank0, get_tp_group
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.sampler import Sampler, SamplerOutput


class Rank0Sampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.is_rank0 = get_tp_group().rank == 0

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # logits: [B, vocab], the same on every rank
        if self.is_rank0:
            out = self.sampler(logits, meta)
        else:  # no logprobs here: only rank 0's output goes back to the engine
            out = SamplerOutput(
                torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
            )
        broadcast_from_rank0(out.sampled)
        return out
