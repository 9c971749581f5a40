"""Sampling from logits in two passes (Triton): greedy or temperature, no top-k/top-p/min-p.

A row with temperature T draws token i with probability softmax(logits / T)[i] by inverting
the cumulative distribution with one uniform per row, in base 2 (scores s_i = logits_i *
log2(e) / T, weights 2^(s_i - max)):

1. `_chunk_stats_kernel`: the vocabulary is cut into chunks of CHUNK tokens, one program
   each (a lone row of 128K tokens read by one program is serial: ~160 us on an H200). Each
   program keeps, per lane, a running max and a running sum of weights relative to it (one
   exp2 per logit), then reduces them to the chunk's max score, its token (the lowest id on
   ties: argmax's rule) and the chunk's sum of weights.
2. `_pick_kernel`, one program per row: greedy rows (T < 1e-5) take the best chunk's token;
   other rows draw u from Philox keyed by (seed, row), find the chunk where the cumulative
   weight crosses u * total, and scan that chunk alone for the token where it crosses.

The logits are read once (plus one chunk per row). The earlier one-pass kernel drew a Gumbel
noise per logit (argmax(s_i + G_i)): with 152K Philox draws per row it was compute-bound,
124-127 us for 256 x 151,936 logits on an H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # tokens per loop step
CHUNK = 8 * BLOCK  # tokens per program of the first pass
LOG2E = tl.constexpr(1.4426950408889634)
NO_TOKEN = tl.constexpr(2**31 - 1)


@triton.jit
def _chunk_stats_kernel(
    logits_ptr,  # [B, vocab] float32, bfloat16 or float16
    temperature_ptr,  # [B] float32
    chunk_max_ptr,  # [B, num_chunks] float32: the chunk's best score (base 2)
    chunk_arg_ptr,  # [B, num_chunks] int32: and its token
    chunk_sum_ptr,  # [B, num_chunks] float32: sum of 2^(score - chunk max)
    vocab,
    stride_b,
    num_chunks,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature < 1e-5
    scale = tl.where(greedy, 1.0, LOG2E / tl.where(greedy, 1.0, temperature))  # greedy: raw
    lane = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: best score so far,
    arg = tl.full([BLOCK], NO_TOKEN, tl.int32)  # its token,
    s = tl.zeros([BLOCK], tl.float32)  # and the sum of 2^(score - m)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_b
    for start in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, vocab), BLOCK):
        offs = start + lane
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        x = x * scale
        take = x > m
        # one exp2 per logit: 2^-|x - m| rescales the old sum (x > m) or is the new weight
        e = tl.math.exp2(tl.where(x == float("-inf"), float("-inf"), -tl.abs(x - m)))
        s = tl.where(take, s * e + 1.0, s + e)
        arg = tl.where(take, offs, arg)
        m = tl.maximum(m, x)
    top = tl.max(m, 0)
    idx = tl.min(tl.where(m == top, arg, NO_TOKEN), 0)
    total = tl.sum(s * tl.math.exp2(m - tl.where(top == float("-inf"), 0.0, top)), 0)
    out = row * num_chunks + chunk
    tl.store(chunk_max_ptr + out, top)
    tl.store(chunk_arg_ptr + out, idx)
    tl.store(chunk_sum_ptr + out, total)


@triton.jit(do_not_specialize=["seed"])  # a fresh seed every step: no variants
def _pick_kernel(
    logits_ptr,  # [B, vocab]
    temperature_ptr,  # [B] float32
    chunk_max_ptr,  # [B, num_chunks] float32
    chunk_arg_ptr,  # [B, num_chunks] int32
    chunk_sum_ptr,  # [B, num_chunks] float32
    out_ptr,  # [B] int64
    vocab,
    stride_b,
    num_chunks,
    seed,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,  # >= num_chunks
):
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature < 1e-5
    offs_c = tl.arange(0, BLOCK_C)
    stats = row * num_chunks + offs_c
    ok = offs_c < num_chunks
    cmax = tl.load(chunk_max_ptr + stats, mask=ok, other=float("-inf"))
    carg = tl.load(chunk_arg_ptr + stats, mask=ok, other=NO_TOKEN)
    top = tl.max(cmax, 0)
    best = tl.minimum(tl.min(tl.where(cmax == top, carg, NO_TOKEN), 0), vocab - 1)
    if greedy or top == float("-inf"):  # every logit -inf: some token
        tl.store(out_ptr + row, best.to(tl.int64))
        return
    # the chunk where the cumulative weight crosses u * total
    w = tl.load(chunk_sum_ptr + stats, mask=ok, other=0.0) * tl.math.exp2(cmax - top)
    cum = tl.cumsum(w, 0)
    target = tl.rand(seed, row) * tl.sum(w, 0)
    c = tl.minimum(tl.sum((cum <= target).to(tl.int32), 0), num_chunks - 1)
    w_c = tl.sum(tl.where(offs_c == c, w, 0.0), 0)
    before = tl.sum(tl.where(offs_c == c, cum, 0.0), 0) - w_c
    m_c = tl.sum(tl.where(offs_c == c, cmax, 0.0), 0)
    # in that chunk's units (weights 2^(score - m_c))
    target_c = (target - before) * tl.math.exp2(top - m_c)
    scale = LOG2E / temperature
    lane = tl.arange(0, BLOCK)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_b
    running = 0.0
    pick = NO_TOKEN
    last = best  # rounding may leave the target unreached: the last token with weight
    for start in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, vocab), BLOCK):
        offs = start + lane
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        p = tl.math.exp2(x * scale - m_c)
        crossed = running + tl.cumsum(p, 0) > target_c
        pick = tl.minimum(pick, tl.min(tl.where(crossed, offs, NO_TOKEN), 0))
        last = tl.maximum(last, tl.max(tl.where(p > 0.0, offs, -1), 0))
        running += tl.sum(p, 0)
    pick = tl.where(pick == NO_TOKEN, last, pick)
    tl.store(out_ptr + row, pick.to(tl.int64))


def sample(
    logits: torch.Tensor,  # [B, vocab] float32 / bfloat16 / float16, contiguous rows
    temperature: torch.Tensor,  # [B] float32
    generator: torch.Generator | None = None,  # host RNG for the step's seed
) -> torch.Tensor:  # [B] int64
    float_types = (torch.float32, torch.bfloat16, torch.float16)
    if logits.dim() != 2 or logits.stride(-1) != 1 or logits.dtype not in float_types:
        shape, dtype = tuple(logits.shape), logits.dtype
        raise ValueError(f"sample: logits must be [B, vocab] float rows, got {shape} {dtype}")
    if temperature.shape != logits.shape[:1] or temperature.dtype != torch.float32:
        raise ValueError(f"sample: temperature must be [B] float32, got {tuple(temperature.shape)}")
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, CHUNK)
    stats = dict(dtype=torch.float32, device=logits.device)
    chunk_max = torch.empty((rows, num_chunks), **stats)
    chunk_sum = torch.empty((rows, num_chunks), **stats)
    chunk_arg = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _chunk_stats_kernel[(rows, num_chunks)](
        logits, temperature, chunk_max, chunk_arg, chunk_sum, vocab, logits.stride(0),
        num_chunks, BLOCK=BLOCK, CHUNK=CHUNK, num_warps=4,
    )  # fmt: skip
    _pick_kernel[(rows,)](
        logits, temperature, chunk_max, chunk_arg, chunk_sum, out, vocab, logits.stride(0),
        num_chunks, seed, BLOCK=BLOCK, CHUNK=CHUNK, BLOCK_C=triton.next_power_of_2(num_chunks),
        num_warps=4,
    )  # fmt: skip
    return out
