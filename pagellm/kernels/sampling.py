"""One-pass sampling from logits (Triton): greedy or temperature, no top-k/top-p/min-p.

`argmax(probs / E)` with E ~ Exponential(1) draws token i with probability probs[i] (the
exponential race; see `pagellm/sample/sampler.py`). In log space that is
`argmax(logits / T - log E)`: no softmax, no normalization, one read of the logits. The
noise comes from Philox keyed by (seed, row, token), four uniforms per call (`tl.rand4x`:
with one call per token the kernel was compute-bound, 186 against 125 us for 256 x 151,936
logits on an H200), with a fresh seed drawn on the host every step (no device sync). Rows
with temperature < 1e-5 take the argmax.

Each row's vocabulary is cut into chunks of CHUNK tokens, one program each (a lone row of
128K tokens read by one program is serial: ~160 us on an H200); a second kernel picks each
row's best chunk. The noise depends only on (seed, row, token), so chunking changes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # tokens per block (a loop step covers 4 blocks: one Philox call each 4 tokens)
CHUNK = 8 * BLOCK  # tokens per program (a multiple of 4 * BLOCK)
LN2 = tl.constexpr(0.6931471805599453)  # ln 2


@triton.jit(do_not_specialize=["seed"])  # a fresh seed every step: no variants
def _sample_chunk_kernel(
    logits_ptr,  # [B, vocab] float32, bfloat16 or float16
    temperature_ptr,  # [B] float32
    best_ptr,  # [B, num_chunks] float32: each chunk's best score
    best_idx_ptr,  # [B, num_chunks] int32: and its token
    vocab,
    stride_b,
    num_chunks,
    seed,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature < 1e-5
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    best = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: best score and its token
    best_idx = tl.full([BLOCK], 2**31 - 1, tl.int32)
    lane = tl.arange(0, BLOCK)
    base = row.to(tl.int64) * vocab
    # one Philox call gives 4 uniforms: each loop step covers 4 blocks of BLOCK tokens, and
    # token start + j * BLOCK + lane takes the j-th uniform of counter base + start + lane
    for start in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, vocab), 4 * BLOCK):
        u4 = tl.rand4x(seed, base + start + lane)  # 4 x [BLOCK] in [0, 1)
        for j in tl.static_range(4):
            offs = start + j * BLOCK + lane
            mask = offs < vocab
            x_ptr = logits_ptr + row.to(tl.int64) * stride_b + offs
            x = tl.load(x_ptr, mask=mask, other=float("-inf")).to(tl.float32)
            u = tl.maximum(u4[j], 1e-10)
            # Gumbel noise -ln(-ln u) = -ln(ln 2) - ln 2 * log2(-log2 u); the constant is the
            # same for every token, so it is left out (log2 is the GPU's fast log)
            noise = -LN2 * tl.log2(-tl.log2(u))
            score = tl.where(greedy, x, x * inv_t + noise)
            take = score > best
            best = tl.where(take, score, best)
            best_idx = tl.where(take, offs, best_idx)
    top = tl.max(best, 0)
    # lowest token id among lanes holding the maximum (argmax's tie rule)
    idx = tl.min(tl.where(best == top, best_idx, 2**31 - 1), 0)
    tl.store(best_ptr + row * num_chunks + chunk, top)
    tl.store(best_idx_ptr + row * num_chunks + chunk, idx)


@triton.jit
def _pick_chunk_kernel(
    best_ptr,  # [B, num_chunks] float32
    best_idx_ptr,  # [B, num_chunks] int32
    out_ptr,  # [B] int64
    vocab,
    num_chunks,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    best = tl.load(best_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    best_idx = tl.load(best_idx_ptr + row * num_chunks + offs, mask=mask, other=2**31 - 1)
    top = tl.max(best, 0)
    idx = tl.min(tl.where(best == top, best_idx, 2**31 - 1), 0)
    tl.store(out_ptr + row, tl.minimum(idx, vocab - 1).to(tl.int64))  # all -inf: some token


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
    best = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _sample_chunk_kernel[(rows, num_chunks)](
        logits, temperature, best, best_idx, vocab, logits.stride(0), num_chunks, seed,
        BLOCK=BLOCK, CHUNK=CHUNK, num_warps=4,
    )  # fmt: skip
    block_c = triton.next_power_of_2(num_chunks)
    _pick_chunk_kernel[(rows,)](best, best_idx, out, vocab, num_chunks, BLOCK_C=block_c)
    return out
