"""Sampler: logits -> next token ids for one step, without a host sync until the caller asks.

First the step's logits processors (`pagellm/sample/logits_processor/`), in their order:
grammar masks, min_tokens and bad_words bans (the logprobs are taken after these), then on a
float32 copy allowed_token_ids, logit_bias and the penalties (repetition, frequency, presence).
Greedy rows take the argmax. Random rows apply temperature, top-k, top-p and min-p, then
draw with the exponential-race trick: argmax(probs / E) with E ~ Exponential(1) picks
token i with probability probs[i], and a per-request torch.Generator makes it reproducible.
On CUDA, a step with only greedy and temperature rows (no top-k/top-p/min-p, no seeded
rows) samples with two Triton kernels that read the logits once: per-chunk statistics,
then one uniform per row inverting the CDF (`pagellm/kernels/sampling.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from pagellm.sample.logits_processor.interface import LogitsProcessor
from pagellm.sample.metadata import SamplingMetadata

_NEG_INF = float("-inf")


class SamplerOutput:
    __slots__ = ("sampled", "logprobs", "logprob_ids", "logprob_ranks")

    def __init__(
        self,
        sampled: torch.Tensor,  # [B] int64
        logprobs: torch.Tensor | None = None,  # [B, 1 + k] float32: sampled, then top-k
        logprob_ids: torch.Tensor | None = None,  # [B, 1 + k] int64
        logprob_ranks: torch.Tensor | None = None,  # [B] int64: the sampled token's vocab rank
    ) -> None:
        self.sampled = sampled
        self.logprobs = logprobs
        self.logprob_ids = logprob_ids
        self.logprob_ranks = logprob_ranks


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # logits: [B, vocab] in the model's dtype (bf16 on GPUs: the fused kernel reads them
        # as they are, half the bytes of a float32 copy); everything else runs in float32
        raw = logits  # logprobs are the model's, with the masks in (min_tokens bans, ...)
        if meta.processors:
            logits, raw = _process(logits, meta.processors)
        sampled = self._sample(logits, meta)
        if meta.max_num_logprobs is None:
            return SamplerOutput(sampled)
        logprobs = gather_logprobs(raw.float(), sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled, *logprobs)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        fused = _fused_sampling(logits, meta)
        if fused is not None:
            return fused.sample(logits, meta.temperature)
        greedy = argmax_rows(logits)  # converting to float32 is exact: the same argmax
        if meta.all_greedy:
            return greedy
        probs = _probs(logits.float(), meta)
        sampled = _exponential_race(probs, meta.generators)
        if meta.all_random:
            return sampled
        return torch.where(meta.temperature < 1e-5, greedy, sampled)


def _fused_sampling(logits: torch.Tensor, meta: SamplingMetadata):
    """pagellm.kernels.sampling where it applies (CUDA, temperature only), else None."""
    plain = meta.top_k is None and meta.top_p is None and meta.min_p is None
    if not (logits.is_cuda and plain and not meta.generators and not meta.all_greedy):
        return None
    try:
        from pagellm.kernels import sampling
    except ImportError:
        return None
    return sampling


def _process(
    logits: torch.Tensor, processors: list[tuple[LogitsProcessor, Any]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits to sample from, logits for the logprobs): the masks in place, then the others
    on one float32 copy (the logprobs' logits stay as the masks left them)."""
    raw = logits
    for proc, args in processors:
        if proc.masks:
            logits = raw = proc.apply(logits, args)
            continue
        if logits is raw:
            logits = logits.to(torch.float32, copy=True)
        logits = proc.apply(logits, args)
    return logits, raw


def _probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    temperature = torch.where(meta.temperature < 1e-5, 1.0, meta.temperature)
    logits = logits / temperature.unsqueeze(1)
    if meta.top_k is not None or meta.top_p is not None:
        logits = _apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    probs = logits.softmax(dim=-1)
    if meta.min_p is not None:
        keep = probs >= meta.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs * keep
    return probs


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        k = torch.where(top_k > 0, top_k, logits.shape[-1])
        drop |= ranks.unsqueeze(0) >= k.unsqueeze(1)
    if top_p is not None:
        probs = sorted_logits.masked_fill(drop, _NEG_INF).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
        drop |= mass_before >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_()
    for row, gen in generators.items():
        noise[row].exponential_(generator=gen)
    return argmax_rows(probs / noise)


_ARGMAX_CHUNKS = (1024, 512, 256, 128)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for `x [B, V]`, the same indices (ties: the first), faster on CPU.

    The CPU argmax kernel is not vectorized (~4.5 GB/s) while `amax` is (~50 GB/s): take
    each row's first chunk (1024 wide, or the widest of `_ARGMAX_CHUNKS` that divides V) that
    holds its maximum, then the argmax inside that chunk.
    """
    rows, width = x.shape
    size = next((c for c in _ARGMAX_CHUNKS if width % c == 0 and width > c), None)
    if x.is_cuda or size is None:
        return x.argmax(dim=-1)
    chunks = x.view(rows, width // size, size)
    best = chunks.amax(dim=-1).argmax(dim=-1)  # [B] first chunk holding the row maximum
    inside = chunks[torch.arange(rows, device=x.device), best].argmax(dim=-1)
    return best * size + inside


def gather_logprobs(
    logits: torch.Tensor, sampled: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([B, 1 + k] logprobs, [B, 1 + k] ids): those of `sampled`, then the top k, best first;
    and [B] the rank of `sampled` in the vocabulary (1: the likeliest; as vLLM, the number of
    tokens at least as likely)."""
    logprobs = logits.log_softmax(dim=-1)  # [B, V]
    chosen = logprobs.gather(-1, sampled.unsqueeze(1))  # [B, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)  # [B]
    if k == 0:
        return chosen, sampled.unsqueeze(1), ranks
    top_vals, top_ids = logprobs.topk(k, dim=-1)  # [B, k]
    values = torch.cat([chosen, top_vals], 1)
    return values, torch.cat([sampled.unsqueeze(1), top_ids], 1), ranks
