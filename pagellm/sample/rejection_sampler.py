"""Verification of draft tokens (speculative decoding): the accepted drafts and one token more.

A request verifying k drafts brings k + 1 rows of logits: row j (0..k) is the target model's
next-token distribution after the request's tokens and drafts 1..j. Each row first goes
through the step's logits processors and settings as a sampled row would (temperature, top-k,
top-p, min-p: the target distribution p_j). Then, left to right:

- greedy rows accept draft j while it is the argmax of row j; the first row whose argmax
  differs, or row k, gives the token after the accepted drafts. The output is token for
  token what decoding without drafts gives.
- random rows (Leviathan et al., "Fast Inference from Transformers via Speculative
  Decoding") accept draft d_j with probability min(1, p_j(d_j) / q_j(d_j)), q_j the
  proposer's distribution; the first rejected row draws from the residual
  max(p_j - q_j, 0), renormalized, and row k (all accepted) draws from p_k. Every token then
  follows the target's distribution exactly, whatever the drafts.
- Our proposers draft deterministically (q_j one-hot at d_j): then each row draws its own
  token t_j from p_j by the exponential race and accepts d_j iff t_j == d_j. That is the
  rule above (t_j = d_j with probability p_j(d_j); otherwise t_j follows p_j without d_j,
  the residual), and each token is the row's own draw whether or not it had a draft.

A seeded request draws each token from a generator seeded by its seed and the token's
position (`position_generators`): with one-hot drafts, how many drafts a step had (which
depends on the batch: the token budget cuts drafts) and preemptions do not change its output.
"""

from __future__ import annotations

import numpy as np
import torch

from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.sampler import (
    SamplerOutput,
    _exponential_race,
    _probs,
    _process,
    argmax_rows,
    gather_logprobs,
)
from pagellm.utils import to_device


def position_generators(
    seeds: dict[int, int], positions: np.ndarray, device: torch.device
) -> dict[int, torch.Generator]:
    """{flat row: a generator for the token at positions[row] of a request seeded `seed`}."""
    return {
        row: torch.Generator(device).manual_seed(
            (seed * 0x9E3779B97F4A7C15 + int(positions[row])) % (1 << 63)
        )
        for row, seed in seeds.items()
    }


class VerifyLayout:
    """Where each request's verify rows sit in the flat [N] rows (host arrays): request i
    has num_drafts[i] + 1 rows from starts[i]; `index` [S, K + 1] pads each request's rows
    to the longest (repeating its last row), `valid` marks the real ones."""

    def __init__(self, num_drafts: np.ndarray) -> None:
        self.num_drafts = num_drafts.astype(np.int64)  # [S]
        counts = self.num_drafts + 1
        self.starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.num_rows = int(counts.sum())
        width = int(counts.max())
        j = np.arange(width)[None, :]
        self.valid = j < counts[:, None]  # [S, K + 1]
        self.index = self.starts[:, None] + np.minimum(j, self.num_drafts[:, None])
        self.is_draft = j < self.num_drafts[:, None]  # [S, K + 1]: rows that verify a draft


def verify(
    logits: torch.Tensor,  # [N, vocab] every verify row of the step
    meta: SamplingMetadata,  # N rows (a request's settings on each of its rows)
    draft_ids: torch.Tensor,  # [N] int64 the draft each row verifies (-1: the last row)
    layout: VerifyLayout,
    draft_probs: torch.Tensor | None = None,  # [N, vocab] q_j; None: one-hot drafts
) -> tuple[torch.Tensor, SamplerOutput]:
    """([S, K + 1] int64 tokens per request: its accepted drafts and the token after them,
    -1 beyond; and per flat row the token it gave, with logprobs when the step wants them)."""
    raw = logits
    if meta.processors:
        logits, raw = _process(logits, meta.processors)
    greedy = argmax_rows(logits)
    if meta.all_greedy:
        accept, choice = greedy == draft_ids, greedy
    else:
        probs = _probs(logits.float(), meta)
        accept, choice = _accept_random(probs, draft_ids, draft_probs, meta.generators)
        if not meta.all_random:
            is_greedy = meta.temperature < 1e-5
            accept = torch.where(is_greedy, greedy == draft_ids, accept)
            choice = torch.where(is_greedy, greedy, choice)
    device = logits.device
    index = to_device(layout.index, device)
    is_draft = to_device(layout.is_draft, device)
    accepted = (accept[index] & is_draft).int().cumprod(dim=1).bool()  # [S, K + 1]
    num_accepted = accepted.sum(dim=1, keepdim=True)  # [S, 1]
    j = torch.arange(index.shape[1], device=device)[None, :]
    tokens = torch.where(accepted, draft_ids[index], choice[index])
    tokens = torch.where(j <= num_accepted, tokens, -1)
    # per flat row: the token it gave (a draft it accepted, else its own draw)
    flat = torch.where(accept & (draft_ids >= 0), draft_ids, choice)
    if meta.max_num_logprobs is None:
        return tokens, SamplerOutput(flat)
    return tokens, SamplerOutput(flat, *gather_logprobs(raw.float(), flat, meta.max_num_logprobs))


def _accept_random(
    probs: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generators: dict[int, torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] bool: the row's draft is accepted, [N] the row's own draw: from the residual
    where it verifies a draft, from p where it is a request's last row)."""
    has_draft = draft_ids >= 0
    if draft_probs is None:  # q = one-hot(d): the row's draw decides
        choice = _exponential_race(probs, generators)
        return has_draft & (choice == draft_ids), choice
    d = draft_ids.clamp(min=0).unsqueeze(1)
    p_d, q_d = probs.gather(1, d).squeeze(1), draft_probs.gather(1, d).squeeze(1)
    uniform = torch.rand(probs.shape[0], device=probs.device)
    for row, gen in generators.items():
        uniform[row] = torch.rand(1, generator=gen, device=probs.device)[0]
    accept = has_draft & (uniform * q_d < p_d)
    residual = (probs - draft_probs).clamp_(min=0)
    residual = torch.where(has_draft.unsqueeze(1), residual, probs)
    return accept, _exponential_race(residual, generators)
