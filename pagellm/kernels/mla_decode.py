"""Latent attention (MLA) decode over the paged latent cache (Triton).

The cache of a layer is `[1, num_blocks, block_size, 1, R + P]`: a token's latent c (R =
kv_lora_rank) then its rotated key part (P = qk_rope_head_dim), shared by all heads. A decode
query arrives absorbed (`pagellm/attention/mla.py`): `q = [q_nope W_UK, q_pe]`, [H, R + P],
so head h's score for token j is `q_h . row_j` and its (latent) output `sum_j p_hj c_j`.

One program computes BLOCK_H heads of one request (row r of the batch is the decode of
request r: a decode-only step), walking its keys BLOCK_N at a time through the block table
with an online softmax in float32 (exp2, the scale folded with log2 e). The heads share
every key tile they load, so a tile of R + P numbers a token feeds BLOCK_H rows of `tl.dot`:
the cache is read once for BLOCK_H heads, not once a head. No split over the keys: a step
with few requests and long contexts runs few programs (a later split-KV variant's job).

Everything it reads is on the device (block table, sequence lengths), so a CUDA graph
replays it; a padded row (CUDA-graph padding: sequence length 1 in the null block) computes
a value nobody reads. A row of sequence length 0 writes zeros.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    if FP32_DOT:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _mla_decode_kernel(
    q_ptr,  # [n, H, R + P] absorbed queries
    cache_ptr,  # [1, num_blocks, block_size, 1, R + P]
    block_table_ptr,  # [num_reqs, max_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    out_ptr,  # [n, H, R] latent outputs
    qk_scale,  # softmax scale * log2(e)
    num_heads,
    stride_qt,
    stride_qh,
    stride_cb,  # cache: between blocks (elements)
    stride_cs,  # cache: between a block's slots
    stride_bt,  # block table: between requests
    stride_ot,
    stride_oh,
    RANK: tl.constexpr,  # R
    ROPE: tl.constexpr,  # P
    RANK_PAD: tl.constexpr,  # powers of two >= R, P
    ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads a program (tl.dot: every dim >= 16, so the pads too)
    BLOCK_N: tl.constexpr,  # keys a step
    BLOCK_SIZE: tl.constexpr,  # tokens a cache block
    FP32_DOT: tl.constexpr = False,  # float32 inputs: exact products (no tf32)
):
    req = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, RANK_PAD)
    offs_p = tl.arange(0, ROPE_PAD)
    head_ok = heads < num_heads
    q_rows = q_ptr + req * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + offs_r[None, :], mask=head_ok[:, None] & (offs_r < RANK)[None, :])
    q_pe = tl.load(
        q_rows + RANK + offs_p[None, :], mask=head_ok[:, None] & (offs_p < ROPE)[None, :]
    )
    seq_len = tl.load(seq_lens_ptr + req)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        key_ok = pos < seq_len
        block = tl.load(block_table_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=key_ok)
        rows = cache_ptr + block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs
        lat = tl.load(rows[:, None] + offs_r[None, :], mask=key_ok[:, None] & (offs_r < RANK))
        pe = tl.load(rows[:, None] + RANK + offs_p[None, :], mask=key_ok[:, None] & (offs_p < ROPE))
        lat = lat.to(q_lat.dtype)
        scores = _dot(q_lat, tl.trans(lat), FP32_DOT) + _dot(
            q_pe, tl.trans(pe.to(q_pe.dtype)), FP32_DOT
        )
        scores = tl.where(key_ok[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = acc * alpha[:, None] + _dot(p.to(lat.dtype), lat, FP32_DOT)
        m = m_new
    acc = acc / tl.where(l > 0, l, 1.0)[:, None]
    out_rows = out_ptr + req * stride_ot + heads[:, None] * stride_oh + offs_r[None, :]
    tl.store(out_rows, acc.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & (offs_r < RANK))


def mla_decode(
    q: torch.Tensor,  # [n, H, R + P] absorbed queries; row r: request r's decode
    kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, R + P]
    block_table: torch.Tensor,  # [>= n, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= n] int32
    rank: int,  # R
    scale: float,  # softmax scale
    block_n: int = 32,
) -> torch.Tensor:  # [n, H, R] in q's dtype
    """softmax(scale * q_h . rows) @ c over each request's cached rows, per head."""
    n, num_heads, width = q.shape
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 1 or kv_cache.shape[3] != 1:
        raise ValueError(
            f"a latent cache is [1, blocks, block_size, 1, R + P], got {kv_cache.shape}"
        )
    if kv_cache.shape[-1] != width or not 0 < rank < width:
        raise ValueError(
            f"q rows of {width} (R = {rank}) against cache rows of {kv_cache.shape[-1]}"
        )
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and the cache need contiguous rows")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_table and seq_lens must be int32")
    out = torch.empty(n, num_heads, rank, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    rope = width - rank
    block_h = 16
    grid = (n, triton.cdiv(num_heads, block_h))
    _mla_decode_kernel[grid](
        q, kv_cache, block_table, seq_lens, out, scale * math.log2(math.e), num_heads,
        q.stride(0), q.stride(1), kv_cache.stride(1), kv_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1),
        RANK=rank, ROPE=rope, RANK_PAD=max(16, triton.next_power_of_2(rank)),
        ROPE_PAD=max(16, triton.next_power_of_2(rope)), BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_SIZE=kv_cache.shape[2], FP32_DOT=q.dtype == torch.float32,
    )  # fmt: skip
    return out
