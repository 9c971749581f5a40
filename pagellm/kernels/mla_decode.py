"""Latent attention (MLA) decode over the paged latent cache (Triton).

The cache of a layer is `[1, num_blocks, block_size, 1, R + P]`: a token's latent c (R =
kv_lora_rank) then its rotated key part (P = qk_rope_head_dim), shared by all heads. A decode
query arrives absorbed (`pagellm/attention/mla.py`): `q = [q_nope W_UK, q_pe]`, [H, R + P],
so head h's score for token j is `q_h . row_j` and its (latent) output `sum_j p_hj c_j`.

One program computes BLOCK_H heads of one request (row r of the batch is the decode of
request r in a decode-only step, of request reqs[r] in a mixed one) over one segment of its
keys, walking them BLOCK_N at a time through the block table with an online softmax in
float32 (exp2, the scale folded with log2 e). The heads share every key tile they load, so
a tile of R + P numbers a token feeds BLOCK_H rows of `tl.dot`: the cache is read once for
BLOCK_H heads, not once a head.

Split-KV: with few requests (DeepSeek-V2-Lite has 16 heads: one program a request) the keys
are cut into `num_splits` segments, each program writing its partial (max, sum, acc) in
float32; `_combine` merges them in torch (device ops only). The segment length comes from
each request's own length inside the kernel, so any split count is right for any lengths;
the count (from the step's longest length and the GPU's SMs) only changes the speed.

Everything it reads is on the device (block table, sequence lengths), so a CUDA graph
replays it; a padded row (CUDA-graph padding: sequence length 1 in the null block) computes
a value nobody reads. A row of sequence length 0 writes zeros.
"""

from __future__ import annotations

import functools
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
    reqs_ptr,  # HAS_REQS: [n] int32, the request of each query row
    out_ptr,  # [n, H, R] latent outputs (SPLIT: [n, S, H, R] float32 partial sums)
    ml_ptr,  # SPLIT: [n, S, H, 2] float32 running max (log2 units) and sum
    qk_scale,  # softmax scale * log2(e)
    num_heads,
    num_splits,
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
    SPLIT: tl.constexpr = False,  # write partials for `_combine`
    HAS_REQS: tl.constexpr = False,  # False: query row r is request r's decode
):
    row_id = tl.program_id(0).to(tl.int64)
    req = row_id
    if HAS_REQS:
        req = tl.load(reqs_ptr + row_id).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    q_lat, q_pe = _queries(q_ptr, row_id, heads, head_ok, stride_qt, stride_qh, RANK, ROPE,
                           RANK_PAD, ROPE_PAD)  # fmt: skip
    seq_len = tl.load(seq_lens_ptr + req)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    # this program's segment of the keys: whole BLOCK_N steps, from its request's length
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    first = tl.program_id(2) * per_split
    last = tl.minimum(first + per_split, seq_len)
    for start in range(first, last, BLOCK_N):
        m, l, acc = _attend_step(q_lat, q_pe, m, l, acc, start, last,  # noqa: E741
                                 block_table_ptr + req * stride_bt, cache_ptr, qk_scale,
                                 stride_cb, stride_cs, RANK, ROPE, RANK_PAD, ROPE_PAD, BLOCK_N,
                                 BLOCK_SIZE, FP32_DOT)  # fmt: skip
    _store(acc, m, l, row_id, heads, head_ok, out_ptr, ml_ptr, num_heads, num_splits,
           stride_ot, stride_oh, RANK, RANK_PAD, SPLIT)  # fmt: skip


@triton.jit
def _queries(q_ptr, row_id, heads, head_ok, stride_qt, stride_qh, RANK: tl.constexpr,
             ROPE: tl.constexpr, RANK_PAD: tl.constexpr, ROPE_PAD: tl.constexpr):  # fmt: skip
    """The row's queries for `heads`: latent [BLOCK_H, RANK_PAD], rotary [BLOCK_H, ROPE_PAD]."""
    offs_r = tl.arange(0, RANK_PAD)
    offs_p = tl.arange(0, ROPE_PAD)
    q_rows = q_ptr + row_id * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + offs_r[None, :], mask=head_ok[:, None] & (offs_r < RANK)[None, :])
    q_pe = tl.load(
        q_rows + RANK + offs_p[None, :], mask=head_ok[:, None] & (offs_p < ROPE)[None, :]
    )
    return q_lat, q_pe


@triton.jit
def _attend_step(q_lat, q_pe, m, l, acc, start, last, bt_row, cache_ptr, qk_scale, stride_cb,  # noqa: E741
                 stride_cs, RANK: tl.constexpr, ROPE: tl.constexpr, RANK_PAD: tl.constexpr,
                 ROPE_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 FP32_DOT: tl.constexpr):  # fmt: skip
    """Keys start .. start + BLOCK_N (those below `last`), read through the request's block
    table row: the online softmax's running max m, sum l and latent accumulator acc, updated.
    Each cache row's latent part is both the key (with the rotary part) and the value."""
    offs_r = tl.arange(0, RANK_PAD)
    offs_p = tl.arange(0, ROPE_PAD)
    pos = start + tl.arange(0, BLOCK_N)
    key_ok = pos < last
    block = tl.load(bt_row + pos // BLOCK_SIZE, mask=key_ok)
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
    return m_new, l, acc


@triton.jit
def _store(acc, m, l, row_id, heads, head_ok, out_ptr, ml_ptr, num_heads, num_splits,  # noqa: E741
           stride_ot, stride_oh, RANK: tl.constexpr, RANK_PAD: tl.constexpr,
           SPLIT: tl.constexpr):  # fmt: skip
    """SPLIT: the unnormalized partials and (m, l) at [row, split, head] (contiguous float32
    buffers, `_combine` merges them); else the normalized output rows."""
    offs_r = tl.arange(0, RANK_PAD)
    out_mask = head_ok[:, None] & (offs_r < RANK)[None, :]
    if SPLIT:
        row = (row_id * num_splits + tl.program_id(2)) * num_heads + heads
        tl.store(out_ptr + row[:, None] * RANK + offs_r[None, :], acc, mask=out_mask)
        tl.store(ml_ptr + row * 2, m, mask=head_ok)
        tl.store(ml_ptr + row * 2 + 1, l, mask=head_ok)
    else:
        acc = acc / tl.where(l > 0, l, 1.0)[:, None]
        out_rows = out_ptr + row_id * stride_ot + heads[:, None] * stride_oh + offs_r[None, :]
        tl.store(out_rows, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


TARGET_PROGRAMS_PER_SM = 2
MAX_SPLITS = 64


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: an H100's count, so tests split as an H100 would
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(programs: int, max_seq_len: int, block_n: int, num_sms: int) -> int:
    """Segments a request's keys are cut into: enough programs for two per SM, no segment
    shorter than one BLOCK_N step of the longest request."""
    wanted = triton.cdiv(TARGET_PROGRAMS_PER_SM * num_sms, programs)
    return max(1, min(wanted, triton.cdiv(max_seq_len, block_n), MAX_SPLITS))


def mla_decode(
    q: torch.Tensor,  # [n, H, R + P] absorbed queries; row r: request r's decode (or reqs[r]'s)
    kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, R + P]
    block_table: torch.Tensor,  # [>= n, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= n] int32
    rank: int,  # R
    scale: float,  # softmax scale
    max_seq_len: int = 0,  # the longest of seq_lens[:n] (host): picks the split count
    block_n: int = 32,
    num_splits: int | None = None,  # None: `choose_num_splits`
    reqs: torch.Tensor | None = None,  # [n] int32: the request of each row (a mixed step)
    block_h: int = 16,  # heads a program: each program reads its request's rows once
    num_warps: int = 4,
) -> torch.Tensor:  # [n, H, R] in q's dtype
    """softmax(scale * q_h . rows) @ c over each request's cached rows, per head."""
    n, num_heads, width = q.shape
    _check(q, kv_cache, block_table, seq_lens, rank)
    if block_h < 16 or block_h & (block_h - 1):
        raise ValueError(f"block_h must be a power of two >= 16, got {block_h}")
    out = torch.empty(n, num_heads, rank, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    grid_heads = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = choose_num_splits(n * grid_heads, max_seq_len, block_n, _num_sms(q.device))
    split = num_splits > 1
    target, ml = out, out  # ml unused without splits
    if split:
        target = torch.empty(n, num_splits, num_heads, rank, dtype=torch.float32, device=q.device)
        ml = torch.empty(n, num_splits, num_heads, 2, dtype=torch.float32, device=q.device)
    if reqs is not None and (reqs.dtype != torch.int32 or reqs.shape != (n,)):
        raise ValueError(f"reqs must be [{n}] int32, got {tuple(reqs.shape)} {reqs.dtype}")
    _mla_decode_kernel[(n, grid_heads, num_splits)](
        q, kv_cache, block_table, seq_lens, seq_lens if reqs is None else reqs, target, ml,
        scale * math.log2(math.e), num_heads, num_splits, q.stride(0), q.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), block_table.stride(0), out.stride(0),
        out.stride(1),
        RANK=rank, ROPE=width - rank, RANK_PAD=max(16, triton.next_power_of_2(rank)),
        ROPE_PAD=max(16, triton.next_power_of_2(width - rank)), BLOCK_H=block_h,
        BLOCK_N=block_n, BLOCK_SIZE=kv_cache.shape[2], FP32_DOT=q.dtype == torch.float32,
        SPLIT=split, HAS_REQS=reqs is not None, num_warps=num_warps,
    )  # fmt: skip
    if split:
        out.copy_(_combine(target, ml))
    return out


def _combine(acc: torch.Tensor, ml: torch.Tensor) -> torch.Tensor:
    """Merge the segments' partials: acc [n, S, H, R], (max, sum) [n, S, H, 2] -> [n, H, R]
    float32 (an empty segment: max -inf, sum 0; a request with no keys: zeros)."""
    m, l = ml.unbind(-1)  # noqa: E741
    top = m.amax(dim=1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weight = torch.exp2(m - top)  # [n, S, H]
    total = (l * weight).sum(dim=1)  # [n, H]
    merged = (acc * weight[..., None]).sum(dim=1)  # [n, H, R]
    return merged / torch.where(total > 0, total, torch.ones_like(total))[..., None]


def _check(q, kv_cache, block_table, seq_lens, rank) -> None:
    width = q.shape[-1]
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 1 or kv_cache.shape[3] != 1:
        raise ValueError(
            f"a latent cache is [1, blocks, block_size, 1, R + P], got {tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[-1] != width or not 0 < rank < width:
        raise ValueError(
            f"q rows of {width} (R = {rank}) against cache rows of {kv_cache.shape[-1]}"
        )
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and the cache need contiguous rows")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_table and seq_lens must be int32")
