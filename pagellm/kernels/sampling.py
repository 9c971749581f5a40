"""One-pass sampling from logits (Triton): greedy or temperature, no top-k/top-p/min-p.

`argmax(probs / E)` with E ~ Exponential(1) draws token i with probability probs[i] (the
exponential race; see `pagellm/sample/sampler.py`). In log space that is
`argmax(logits / T - log E)`: no softmax, no normalization, one read of the logits. The
noise comes from Philox (`tl.rand`) keyed by (seed, row, token), with a fresh seed drawn
on the host every step (no device sync). Rows with temperature < 1e-5 take the argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["seed"])  # a fresh seed every step: no variants
def _sample_kernel(
    logits_ptr,  # [B, vocab] float32
    temperature_ptr,  # [B] float32
    out_ptr,  # [B] int64
    vocab,
    stride_b,
    seed,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature < 1e-5
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    best = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: best score and its token
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_b + offs, mask=mask, other=float("-inf"))
        u = tl.rand(seed, row.to(tl.int64) * vocab + offs)  # [0, 1)
        noise = -tl.log(-tl.log(tl.maximum(u, 1e-10)))  # Gumbel: -log(E), E = -log(u)
        score = tl.where(greedy, x, x * inv_t + noise)
        take = score > best
        best = tl.where(take, score, best)
        best_idx = tl.where(take, offs, best_idx)
    top = tl.max(best, 0)
    # lowest token id among lanes holding the maximum (argmax's tie rule)
    idx = tl.min(tl.where(best == top, best_idx, vocab), 0)
    tl.store(out_ptr + row, idx.to(tl.int64))


def sample(
    logits: torch.Tensor,  # [B, vocab] float32, contiguous rows
    temperature: torch.Tensor,  # [B] float32
    generator: torch.Generator | None = None,  # host RNG for the step's seed
) -> torch.Tensor:  # [B] int64
    if logits.dim() != 2 or logits.stride(-1) != 1 or logits.dtype != torch.float32:
        shape = tuple(logits.shape)
        raise ValueError(f"sample: logits must be [B, vocab] float32 rows, got {shape}")
    if temperature.shape != logits.shape[:1] or temperature.dtype != torch.float32:
        raise ValueError(f"sample: temperature must be [B] float32, got {tuple(temperature.shape)}")
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _sample_kernel[(logits.shape[0],)](
        logits, temperature, out, logits.shape[1], logits.stride(0), seed, BLOCK=1024, num_warps=4
    )
    return out
