"""Paged attention for a mixed batch of prefill chunks and decodes (Triton).

Every query token attends causally to its request's cached context and to its own chunk,
reading keys and values only through `block_table`:

    request r:  |<------------------ seq_len ------------------>|
                |<-------- context (ctx) -------->|<-- query -->|
    query i (0 <= i < query_len) sees keys 0 .. ctx + i

Tiling. A program owns one *tile* of rows: BLOCK_Q consecutive query tokens of one request
times HEADS_PER_PROG query heads that share one KV head (GQA), so

    row m -> (query token m // HEADS_PER_PROG, head m % HEADS_PER_PROG)
    BLOCK_M = BLOCK_Q * HEADS_PER_PROG

and every K/V tile it loads serves all of those heads. The grid is
`(num_kv_heads * head_groups, num_tiles, num_splits)`; `head_groups > 1` only when a KV
head has more query heads than one program takes. The program walks the keys in steps of
BLOCK_N, gathering each step's rows from their pages (`block_table[r, n // block_size]`), with
`tl.dot` for QK^T and PV and an online softmax in fp32 (base 2: the softmax scale times
log2(e) goes into exp2's argument). Keys below `ctx + q0 + 1` (q0: first query of the tile)
are visible to every row, so those steps run without masks; the last few steps, up to
`ctx + last query + 1`, apply the causal mask, and nothing beyond them is visited (fully
masked tiles are skipped). The block ids of a step are loaded one step ahead, so Triton's
software pipeliner can keep `num_stages - 2` K/V tiles in flight (cp.async into shared
memory) while one is computed; Q stays in registers/shared memory for the whole walk.

Two launches of the same kernel cover a step (see `plan_attention`):

- decode tiles: requests whose whole query fits one tile with BLOCK_M = 16, the smallest
  `tl.dot` M (query_len 1, or a few speculative tokens). Memory-bound. When there are too
  few (request, KV head) programs to fill the GPU and the contexts are long, the keys are
  cut into `num_splits` segments (flash-decoding): each program writes an unnormalized
  partial output with its running max and sum, and `_combine_splits_kernel` merges them.
- prefill tiles: the other requests, BLOCK_M = 128 rows, compute-bound. The host builds the
  tile -> (request, first query) map, heaviest tiles first, so no program idles on padding.

A decode-only step (every query fits a decode tile) needs no host-built tile map: tile i is
request i, or the order `order_by_length` sorts on the device (the Triton backend's, longest
first). Its split count is fixed by the plan, and segment bounds come from the live
`seq_lens`, so a CUDA graph captured with one plan stays correct for any context lengths.

Per-layer options are compile-time switches, so a layer without them runs the code above
unchanged:

- WINDOW (sliding window W > 0): query i sees keys ctx + i - W < k <= ctx + i. A tile starts
  its walk at the BLOCK_N step holding its first query's first key, so keys below are never
  loaded (nor are their blocks, which may belong to another request by now); the steps up to
  where every row's window has begun, `full_start`, apply the window mask too. Split
  segments divide the keys from there.
- SOFT_CAP_LOG2 (Gemma 2's logit soft-cap c, times log2(e)): scores become
  c * tanh(scale * q.k / c) in registers, before masking and the softmax.
- HAS_SINKS (gpt-oss's attention sinks, a float32 logit per query head): exp(sink) joins
  each row's softmax denominator at the end, `l + exp2(sink * log2(e) - m)` with the row's
  running max m (base 2), in the epilogue or in `_combine_splits_kernel` over the segments'
  merged sums; the walk over the keys is unchanged.
- KV_FP8 (a float8 cache): K/V tiles are read as fp8 (half the bytes of bf16) in int16
  pairs and converted to fp16 in registers (FP8_PAIRS, `pagellm.kernels.fp8_convert`: one
  PTX instruction a pair, before the tile's change to the MMA layout); q is converted to
  fp16 once, so both dots run in fp16 (fp32 stays fp32). k_scale joins the softmax scale
  and v_scale multiplies the accumulator once at the end (`pagellm.kv_cache_dtype`).
  The scales are read from the device, so CUDA graphs replay with scales set after capture.
  fp8 decode tiles are one warp a program (`attention_plan.decode_tile`: by element size and
  query heads a KV head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from pagellm.kernels import fp8_convert, pdl
from pagellm.kernels.attention_plan import (
    MAX_SPLITS,
    AttentionPlan,
    TileConfig,
)
from pagellm.kernels.fp8_convert import fp8_pairs_to_f16, load_fp8_pairs
from pagellm.kv_cache_dtype import is_fp8

LOG2E = 1.4426950408889634

# Split-KV heuristic (decode tiles only): split when the decode launch has fewer programs
# than TARGET_WAVES * num_SMs, into as many segments as fill that target, each segment at
# least MIN_KEYS_PER_SPLIT keys long, at most MAX_SPLITS segments.


@triton.jit
def _block_ids(bt_row, start, kv_end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """[BLOCK_N] physical block of each key in start .. start + BLOCK_N (0 past kv_end)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    return tl.load(bt_row + offs_n // BLOCK_SIZE, mask=offs_n < kv_end, other=0)


@triton.jit
def _tanh(x):
    """tanh as 1 - 2 / (exp(2x) + 1): exactly +-1 where exp2 overflows to inf or reaches 0."""
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)


@triton.jit
def _load_kv_tile(cache_ptr, rows, key_ok, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                  FP8_PAIRS: tl.constexpr, PTX_CVT: tl.constexpr):  # fmt: skip
    """[BLOCK_N, HEAD_DIM] keys (or values) at element offsets `rows` [BLOCK_N] of the cache:
    fp8 through int16 pairs as fp16, else as stored; rows not `key_ok` read as 0."""
    # (one return: compiled Triton refuses a return inside an `if`)
    offs = rows[:, None] + tl.arange(0, HEAD_DIM)[None, :]
    if FP8_PAIRS:
        pairs = load_fp8_pairs(cache_ptr, rows, key_ok, HEAD_DIM)
        tile = fp8_pairs_to_f16(pairs, FP8_PAIRS, PTX_CVT)
    elif MASKED:
        tile = tl.load(cache_ptr + offs, mask=key_ok[:, None], other=0.0)
    else:
        tile = tl.load(cache_ptr + offs)
    return tile


@triton.jit
def _softmax_step(s, m_i, offs_n, key_ok, max_key, qk_scale, MASKED: tl.constexpr,
                  WINDOW: tl.constexpr, SOFT_CAP_LOG2: tl.constexpr):  # fmt: skip
    """Raw scores s [BLOCK_M, BLOCK_N] (q.k) of one key step: soft-capped, masked (causal,
    window, keys past kv_end), and turned into the online softmax's update: p (exp2 of the
    scaled scores less the new running max), alpha (the old sums' rescale), the new max."""
    # the scale is folded into exp2's argument (one FMA)
    if SOFT_CAP_LOG2 > 0.0:  # a float constexpr: compiled Triton needs a comparison
        # c * tanh(scale * s / c), kept in raw units: cap_raw * qk_scale = c * log2(e)
        cap_raw = SOFT_CAP_LOG2 / qk_scale
        s = _tanh(s * (1.0 / cap_raw)) * cap_raw
    if MASKED:
        visible = (offs_n[None, :] <= max_key[:, None]) & key_ok[None, :]
        if WINDOW:
            visible = visible & (offs_n[None, :] > max_key[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if MASKED:
        # a row may have seen no key yet (split segments, rows past the query): keep it finite
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    alpha = tl.math.exp2(m_i - m_new_safe)
    p = tl.math.exp2(s * qk_scale - m_new_safe[:, None])
    return p, alpha, m_new


@triton.jit
def _attend_block(
    acc,  # [BLOCK_M, HEAD_DIM] fp32, unnormalized output
    m_i,  # [BLOCK_M] fp32, running max (base-2 logits)
    l_i,  # [BLOCK_M] fp32, running sum of exp2
    q,  # [BLOCK_M, HEAD_DIM]
    block,  # [BLOCK_N] physical block of each key of this step
    start,  # first key of this step
    kv_end,  # keys >= kv_end are masked for every row
    max_key,  # [BLOCK_M] last key each row may see (causal)
    win_start,  # WINDOW: keys < win_start are masked (and not loaded) for every row
    k_cache_ptr,
    v_cache_ptr,
    kv_head_offset,
    qk_scale,
    stride_cb,
    stride_cs,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    FP32_DOT: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP_LOG2: tl.constexpr,
    FP8_PAIRS: tl.constexpr,
    PTX_CVT: tl.constexpr,
):
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        key_ok = offs_n < kv_end
        if WINDOW:
            key_ok = key_ok & (offs_n >= win_start)
    else:
        key_ok = offs_n >= 0  # every key (the fp8 pair loads take a mask regardless)
    # [BLOCK_N] element offset of each key's head vector in the K (and V) cache
    rows = block.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kv_head_offset
    k = _load_kv_tile(k_cache_ptr, rows, key_ok, HEAD_DIM, MASKED, FP8_PAIRS, PTX_CVT)
    k = k.to(q.dtype)  # fp8 cache: dequantized in registers (k_scale is in qk_scale)

    if FP32_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    p, alpha, m_new = _softmax_step(s, m_i, offs_n, key_ok, max_key, qk_scale, MASKED, WINDOW,
                                    SOFT_CAP_LOG2)  # fmt: skip
    l_i = l_i * alpha + tl.sum(p, 1)

    v = _load_kv_tile(v_cache_ptr, rows, key_ok, HEAD_DIM, MASKED, FP8_PAIRS, PTX_CVT)
    v = v.to(q.dtype)  # fp8 cache: v_scale multiplies the output at the end
    if FP32_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _attend_range(
    acc, m_i, l_i, q, lo, hi, kv_end, max_key, win_start, k_cache_ptr, v_cache_ptr, bt_row,
    kv_head_offset, qk_scale, stride_cb, stride_cs,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr, FP32_DOT: tl.constexpr, WINDOW: tl.constexpr,
    SOFT_CAP_LOG2: tl.constexpr, FP8_PAIRS: tl.constexpr, PTX_CVT: tl.constexpr,
):  # fmt: skip
    """Keys lo .. hi (multiples of BLOCK_N apart) in BLOCK_N steps.

    Each step's block ids are loaded one step ahead and carried: the K/V loads then depend
    on no load of their own iteration, and Triton's pipeliner keeps num_stages - 2 K/V
    tiles in flight while one is computed. (With the ids loaded in the step itself it
    issued each K/V tile only after the previous step's math: no overlap at all.)
    """
    block = _block_ids(bt_row, lo, kv_end, BLOCK_N, BLOCK_SIZE)
    for start in range(lo, hi, BLOCK_N):
        next_block = _block_ids(bt_row, start + BLOCK_N, kv_end, BLOCK_N, BLOCK_SIZE)
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, block, start, kv_end, max_key, win_start, k_cache_ptr,
            v_cache_ptr, kv_head_offset, qk_scale, stride_cb, stride_cs,
            BLOCK_N, HEAD_DIM, BLOCK_SIZE, MASKED, FP32_DOT, WINDOW, SOFT_CAP_LOG2,
            FP8_PAIRS, PTX_CVT,
        )  # fmt: skip
        block = next_block
    return acc, m_i, l_i


@triton.jit
def _walk_keys(
    q, lo, hi, kv_end, full_start, full_end, max_key, win_start, k_cache_ptr, v_cache_ptr,
    bt_row, kv_head_offset, qk_scale, stride_cb, stride_cs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP32_DOT: tl.constexpr, WINDOW: tl.constexpr,
    SOFT_CAP_LOG2: tl.constexpr, FP8_PAIRS: tl.constexpr, PTX_CVT: tl.constexpr,
):  # fmt: skip
    """The tile's keys lo .. hi: the window's edge (masked), the keys every row sees
    (unmasked), the causal tail (masked). Returns (acc, running max, running sum)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if WINDOW:  # the window's edge: keys some rows of the tile no longer see
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, lo, tl.minimum(hi, full_start), kv_end, max_key, win_start,
            k_cache_ptr, v_cache_ptr, bt_row, kv_head_offset, qk_scale, stride_cb, stride_cs,
            BLOCK_N, HEAD_DIM, BLOCK_SIZE, True, FP32_DOT, WINDOW, SOFT_CAP_LOG2, FP8_PAIRS,
            PTX_CVT,
        )  # fmt: skip
        lo = tl.maximum(lo, full_start)
        full_end = tl.maximum(full_end, full_start)
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, lo, tl.minimum(hi, full_end), kv_end, max_key, win_start,
        k_cache_ptr, v_cache_ptr, bt_row, kv_head_offset, qk_scale, stride_cb, stride_cs,
        BLOCK_N, HEAD_DIM, BLOCK_SIZE, False, FP32_DOT, WINDOW, SOFT_CAP_LOG2, FP8_PAIRS,
        PTX_CVT,
    )  # fmt: skip
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, tl.maximum(lo, full_end), hi, kv_end, max_key, win_start,
        k_cache_ptr, v_cache_ptr, bt_row, kv_head_offset, qk_scale, stride_cb, stride_cs,
        BLOCK_N, HEAD_DIM, BLOCK_SIZE, True, FP32_DOT, WINDOW, SOFT_CAP_LOG2, FP8_PAIRS,
        PTX_CVT,
    )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _tile_queries(tile, tile_req_ptr, tile_q_ptr, query_start_loc_ptr, HAS_TILE_MAP: tl.constexpr):
    """The prologue of both kernels: a tile's request, its first query within the request,
    and the request's first token and query length (without a tile map, tile i is request i
    from query 0)."""
    if HAS_TILE_MAP:
        req = tl.load(tile_req_ptr + tile)
        q0 = tl.load(tile_q_ptr + tile)
    else:
        req = tile
        q0 = 0
    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    return req, q0, q_begin, q_len


@triton.jit
def _key_range(ctx, q0, kv_end, split, num_splits, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
               SPLIT: tl.constexpr):  # fmt: skip
    """The keys lo .. hi this program walks (SPLIT: its segment of them), the tile's first
    visible key `win_start` and `full_start`, from which keys are inside every row's window
    (WINDOW; else both 0)."""
    lo = 0
    win_start = 0
    full_start = 0
    if WINDOW:
        win_start = ctx + q0 - WINDOW + 1  # the tile's first visible key (may be < 0)
        lo = (tl.maximum(win_start, 0) // BLOCK_N) * BLOCK_N  # steps below: skipped
        # keys from full_start on are inside every row's window (the last row's starts last)
        full_start = tl.cdiv(tl.maximum(kv_end - WINDOW, 0), BLOCK_N) * BLOCK_N
    hi = kv_end
    if SPLIT:
        seg = tl.cdiv(tl.cdiv(kv_end - lo, num_splits), BLOCK_N) * BLOCK_N
        lo = lo + split * seg
        hi = tl.minimum(lo + seg, kv_end)
    return lo, hi, win_start, full_start


@triton.jit
def _tile_q(q_ptr, pid_head, kv_head, q0, q_begin, q_len, stride_qt, stride_qh,
            BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PER_PROG: tl.constexpr,
            HEAD_GROUPS: tl.constexpr, QUERIES_PER_KV: tl.constexpr, FP8_PAIRS: tl.constexpr,
            FP32_DOT: tl.constexpr):  # fmt: skip
    """The tile's rows and its q [BLOCK_M, HEAD_DIM] (0 on padding rows, in the dots' dtype;
    it stays in registers for the whole walk). Each row m, all [BLOCK_M]: its query token
    within the tile `row_q` and within the chunk `q_idx`, its query head, `row_ok` (false on
    padding: past the query, past the KV head's query heads), its token (row of q and out)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_q = offs_m // HEADS_PER_PROG
    q_idx = q0 + row_q
    head_in_kv = (pid_head % HEAD_GROUPS) * HEADS_PER_PROG + offs_m % HEADS_PER_PROG
    head = kv_head * QUERIES_PER_KV + head_in_kv
    row_ok = (q_idx < q_len) & (head_in_kv < QUERIES_PER_KV)
    token = (q_begin + q_idx).to(tl.int64)
    q_offs = token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0)
    if FP8_PAIRS and not FP32_DOT:
        q = q.to(tl.float16)  # the dots' dtype: fp8 converts to fp16 in one instruction
    return q, row_q, q_idx, head, row_ok, token


@triton.jit
def _tile_keys(ctx, q0, q_idx, q_len, split, num_splits, BLOCK_Q: tl.constexpr,
               BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """The keys of a tile: each row's causal limit `max_key` [BLOCK_M] (inclusive), `kv_end`
    (one past the tile's last visible key), `full_end` (keys below it are visible to every
    row: no mask), and `_key_range`'s walk lo .. hi, win_start and full_start."""
    max_key = ctx + q_idx
    kv_end = ctx + tl.minimum(q0 + BLOCK_Q, q_len)
    full_end = ((ctx + q0 + 1) // BLOCK_N) * BLOCK_N
    lo, hi, win_start, full_start = _key_range(
        ctx, q0, kv_end, split, num_splits, BLOCK_N, WINDOW, SPLIT
    )
    return max_key, kv_end, full_end, lo, hi, win_start, full_start


@triton.jit
def _store_partial(part, acc, m_i, l_i, row_ok, part_acc_ptr, part_max_ptr, part_sum_ptr,
                   HEAD_DIM: tl.constexpr):  # fmt: skip
    """A split's unnormalized rows, their running max and sum, at partial rows `part`."""
    tl.store(part_max_ptr + part, m_i, mask=row_ok)
    tl.store(part_sum_ptr + part, l_i, mask=row_ok)
    acc_offs = part[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(part_acc_ptr + acc_offs, acc, mask=row_ok[:, None])


@triton.jit
def _store_tile(acc, m_i, l_i, row_q, head, row_ok, token, tile, split, num_heads, num_splits,
                out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, kv_scale_ptr, sinks_ptr,
                stride_ot, stride_oh, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
                KV_FP8: tl.constexpr, SPLIT: tl.constexpr, HAS_SINKS: tl.constexpr):  # fmt: skip
    """The epilogue: the rows normalized into out, or (SPLIT) this segment's unnormalized rows
    with their running max and sum, for `_combine_splits_kernel` to merge."""
    if KV_FP8:
        acc = acc * tl.load(kv_scale_ptr + 1)  # a mix of stored values, times v_scale
    if SPLIT:
        # partial results of row (tile, token-in-tile, head, split)
        part = ((tile * BLOCK_Q + row_q) * num_heads + head) * num_splits
        _store_partial(part.to(tl.int64) + split, acc, m_i, l_i, row_ok, part_acc_ptr,
                       part_max_ptr, part_sum_ptr, HEAD_DIM)  # fmt: skip
    else:
        if HAS_SINKS:  # the sink's exp2, relative to the row's max, in the denominator
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
            l_i = l_i + tl.math.exp2(sink - m_i)
        out = acc / l_i[:, None]
        offs_d = tl.arange(0, HEAD_DIM)
        o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_splits"])  # one variant for every split count
def _paged_attention_kernel(
    out_ptr, q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # [num_reqs, max_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    tile_req_ptr, tile_q_ptr,  # [num_tiles] int32: a tile's request, its first query (HAS_TILE_MAP)
    part_acc_ptr,  # [num_tiles, BLOCK_Q, num_heads, num_splits, HEAD_DIM] fp32 (SPLIT)
    part_max_ptr, part_sum_ptr,  # [num_tiles, BLOCK_Q, num_heads, num_splits] fp32
    kv_scale_ptr,  # [2] float32 k_scale, v_scale (KV_FP8)
    sinks_ptr,  # [num_heads] float32 sink logits (HAS_SINKS)
    qk_scale,  # softmax scale * log2(e)
    num_heads,
    num_splits,  # KV segments per tile (grid axis 2); > 1 only with SPLIT
    stride_qt, stride_qh, stride_ot, stride_oh,  # q's and out's: between tokens, heads
    stride_cb, stride_cs, stride_ch,  # the caches': between blocks, slots, KV heads
    stride_bt,  # block_table's rows
    QUERIES_PER_KV: tl.constexpr,  # num_heads // num_kv_heads
    HEAD_GROUPS: tl.constexpr,  # programs per KV head = cdiv(QUERIES_PER_KV, HEADS_PER_PROG)
    HEADS_PER_PROG: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache page
    HAS_TILE_MAP: tl.constexpr,  # False: tile i is request i, starting at query 0
    SPLIT: tl.constexpr,  # write partial results for _combine_splits_kernel
    FP32_DOT: tl.constexpr,
    WINDOW: tl.constexpr = 0,  # sliding window in keys; 0: none
    SOFT_CAP_LOG2: tl.constexpr = 0.0,  # logit soft-cap * log2(e); 0: none
    KV_FP8: tl.constexpr = False,  # float8 cache with per-tensor scales
    FP8_PAIRS: tl.constexpr = 0,  # KV_FP8 as int16 pairs, fp16 dots: 1 e4m3fn, 2 e5m2
    PTX_CVT: tl.constexpr = False,  # FP8_PAIRS converted by PTX (compiled; not interpreted)
    PDL: tl.constexpr = False,  # let the next kernel (o_proj's GEMV) launch now (`kernels.pdl`)
    HAS_SINKS: tl.constexpr = False,  # a sink logit per query head in the denominators
):  # fmt: skip
    """Grid (KV head x head group, tile, key segment): load a tile's q, walk its keys, store."""
    pdl.launch_dependents(PDL)
    BLOCK_M: tl.constexpr = BLOCK_Q * HEADS_PER_PROG
    pid_head, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = pid_head // HEAD_GROUPS
    req, q0, q_begin, q_len = _tile_queries(
        tile, tile_req_ptr, tile_q_ptr, query_start_loc_ptr, HAS_TILE_MAP
    )
    if q0 >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + req) - q_len  # the request's cached context
    q, row_q, q_idx, head, row_ok, token = _tile_q(
        q_ptr, pid_head, kv_head, q0, q_begin, q_len, stride_qt, stride_qh, BLOCK_M, HEAD_DIM,
        HEADS_PER_PROG, HEAD_GROUPS, QUERIES_PER_KV, FP8_PAIRS, FP32_DOT)  # fmt: skip
    max_key, kv_end, full_end, lo, hi, win_start, full_start = _tile_keys(
        ctx, q0, q_idx, q_len, split, num_splits, BLOCK_Q, BLOCK_N, WINDOW, SPLIT
    )
    if KV_FP8:
        qk_scale = qk_scale * tl.load(kv_scale_ptr)  # scores of stored keys times k_scale
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    acc, m_i, l_i = _walk_keys(
        q, lo, hi, kv_end, full_start, full_end, max_key, win_start, k_cache_ptr, v_cache_ptr,
        bt_row, kv_head * stride_ch, qk_scale, stride_cb, stride_cs, BLOCK_M, BLOCK_N, HEAD_DIM,
        BLOCK_SIZE, FP32_DOT, WINDOW, SOFT_CAP_LOG2, FP8_PAIRS, PTX_CVT,
    )  # fmt: skip
    _store_tile(acc, m_i, l_i, row_q, head, row_ok, token, tile, split, num_heads, num_splits,
                out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, kv_scale_ptr, sinks_ptr,
                stride_ot, stride_oh, BLOCK_Q, HEAD_DIM, KV_FP8, SPLIT, HAS_SINKS)  # fmt: skip


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_tiles, BLOCK_Q, num_heads, num_splits, HEAD_DIM] fp32
    part_max_ptr,  # [num_tiles, BLOCK_Q, num_heads, num_splits] fp32
    part_sum_ptr,  # [num_tiles, BLOCK_Q, num_heads, num_splits] fp32
    query_start_loc_ptr,
    tile_req_ptr,
    tile_q_ptr,
    sinks_ptr,  # [num_heads] float32 (HAS_SINKS)
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_TILE_MAP: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # >= num_splits: next_power_of_2(MAX_SPLITS), one variant
    PDL: tl.constexpr = False,  # as _paged_attention_kernel's
    HAS_SINKS: tl.constexpr = False,  # as _paged_attention_kernel's
):
    pdl.launch_dependents(PDL)
    head = tl.program_id(0)
    row = tl.program_id(1)  # tile * BLOCK_Q + token in tile
    req, q0, q_begin, q_len = _tile_queries(
        row // BLOCK_Q, tile_req_ptr, tile_q_ptr, query_start_loc_ptr, HAS_TILE_MAP
    )
    q_idx = q0 + row % BLOCK_Q
    if q_idx >= q_len:
        return

    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    split_ok = offs_s < num_splits
    part = (row.to(tl.int64) * num_heads + head) * num_splits + offs_s  # [SPLITS_PAD]
    m = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=split_ok[:, None],
        other=0.0,
    )  # [SPLITS_PAD, HEAD_DIM]
    m_max = tl.max(m, 0)  # finite: some segment holds the query's own key
    w = tl.math.exp2(m - m_max)  # empty segments have m = -inf: weight 0
    total = tl.sum(l_s * w, 0)
    if HAS_SINKS:
        total += tl.math.exp2(tl.load(sinks_ptr + head) * 1.4426950408889634 - m_max)
    out = tl.sum(acc * w[:, None], 0) / total
    token = (q_begin + q_idx).to(tl.int64)
    o_offs = token * stride_ot + head * stride_oh + offs_d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty))


def _check_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "expected q [num_tokens, num_heads, head_dim] and kv_cache "
            f"[2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(q.shape)} and "
            f"{tuple(kv_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"q has {num_heads} heads of dim {head_dim}; kv_cache has {num_kv_heads} heads of "
            f"dim {kv_cache.shape[4]} (need equal dims and num_heads % num_kv_heads == 0)"
        )
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or (
        q.dtype != kv_cache.dtype and not is_fp8(kv_cache.dtype)
    ):
        raise TypeError(
            f"q must be float and kv_cache of q's dtype or fp8, got {q.dtype}, {kv_cache.dtype}"
        )
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    if query_start_loc.dtype != torch.int32:
        raise TypeError(f"query_start_loc must be int32, got {query_start_loc.dtype}")
    if block_table.dim() != 2 or block_table.stride(1) != 1:
        raise ValueError("block_table must be [num_reqs, max_blocks] with contiguous rows")
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_reqs + 1,) or block_table.shape[0] < num_reqs:
        raise ValueError(
            f"query_start_loc {tuple(query_start_loc.shape)}, seq_lens {tuple(seq_lens.shape)} "
            f"and block_table {tuple(block_table.shape)} disagree on num_reqs"
        )
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache must be contiguous in head_dim (stride(-1) == 1)")
    tensors = (q, kv_cache, block_table, seq_lens, query_start_loc)
    if len({t.device for t in tensors}) != 1:
        raise ValueError("all paged_attention inputs must be on one device")


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, context + query
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    scale: float,
    *,
    plan: AttentionPlan,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    logits_soft_cap: float | None = None,
    kv_scale: torch.Tensor | None = None,  # [2] float32 k_scale, v_scale (fp8 cache)
    sinks: torch.Tensor | None = None,  # [num_heads] float32 sink logits (gpt-oss)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of every query token over its request's paged K/V.

    `plan` comes from `plan_attention` with the same `query_start_loc` / `seq_lens` (on the
    host), the layer's sliding window and the cache's element size. Rows of `out` past
    `query_start_loc[-1]` are left as they were. `logits_soft_cap` c: scores become
    c * tanh(score / c). An fp8 cache is read with `kv_scale` (None: 1.0). `sinks`: each
    query head's logit joins its softmax's denominator.
    """
    _check_inputs(q, kv_cache, block_table, seq_lens, query_start_loc)
    if logits_soft_cap is not None and logits_soft_cap <= 0:
        raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    if (plan.num_heads, plan.num_kv_heads, plan.head_dim) != (
        num_heads,
        kv_cache.shape[3],
        head_dim,
    ):
        raise ValueError("plan was built for a different head layout")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must match q's shape and dtype and be contiguous in head_dim")
    _check_sinks(sinks, q)
    cap_log2 = 0.0 if logits_soft_cap is None else logits_soft_cap * LOG2E
    if is_fp8(kv_cache.dtype) and kv_scale is None:
        kv_scale = torch.ones(2, dtype=torch.float32, device=q.device)
    for launch in plan.launches:
        _launch(
            q, kv_cache, block_table, seq_lens, query_start_loc, scale, out, plan, launch,
            cap_log2, kv_scale, sinks,
        )  # fmt: skip
    return out


def _check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    if sinks is None:
        return
    if sinks.dtype != torch.float32 or sinks.shape != (q.shape[1],) or sinks.stride(0) != 1:
        raise ValueError("sinks must be a contiguous float32 [num_heads] tensor")
    if sinks.device != q.device:
        raise ValueError("sinks must be on q's device")


def _launch(
    q, kv_cache, block_table, seq_lens, query_start_loc, scale, out, plan, launch, cap_log2,
    kv_scale, sinks,
):  # fmt: skip
    """One kernel launch (and its combine, when split) for one group of tiles."""
    cfg = launch.config
    queries_per_kv = plan.num_heads // plan.num_kv_heads
    head_groups = triton.cdiv(queries_per_kv, cfg.heads_per_prog)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    has_map = launch.tile_req is not None
    tile_req = launch.tile_req if has_map else seq_lens  # placeholder pointer when unused
    tile_q = launch.tile_q if has_map else seq_lens
    splits = launch.num_splits
    if splits > 1:
        rows = launch.num_tiles * cfg.block_q
        part_acc = torch.empty(
            (rows, plan.num_heads, splits, plan.head_dim), dtype=torch.float32, device=q.device
        )
        part_max = torch.empty((rows, plan.num_heads, splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused
    grid = (plan.num_kv_heads * head_groups, launch.num_tiles, splits)
    args = (
        out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
        tile_req, tile_q, part_acc, part_max, part_sum,
        seq_lens if kv_scale is None else kv_scale,  # a placeholder pointer when unused
        seq_lens if sinks is None else sinks,
        scale * LOG2E, plan.num_heads, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
    )  # fmt: skip
    constexprs = _constexprs(plan, cfg, q, kv_cache, has_map, splits, cap_log2)
    if sinks is not None:
        constexprs["HAS_SINKS"] = True
    _launch_fitting(grid, args, constexprs, cfg, (q.dtype, kv_cache.dtype))
    if splits > 1:
        _combine_splits_kernel[(plan.num_heads, launch.num_tiles * cfg.block_q)](
            out, part_acc, part_max, part_sum, query_start_loc, tile_req, tile_q,
            seq_lens if sinks is None else sinks,
            plan.num_heads, splits, out.stride(0), out.stride(1),
            BLOCK_Q=cfg.block_q,
            HEAD_DIM=plan.head_dim,
            HAS_TILE_MAP=has_map,
            SPLITS_PAD=triton.next_power_of_2(MAX_SPLITS),
            PDL=constexprs.get("PDL", False),
            HAS_SINKS=sinks is not None,
            num_warps=4,
        )  # fmt: skip


def _constexprs(
    plan: AttentionPlan,
    cfg: TileConfig,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    has_map: bool,
    splits: int,
    cap_log2: float,
) -> dict:
    """The kernel's compile-time switches for one launch (a layer without a window, soft-cap
    or fp8 cache leaves them at the kernel's defaults)."""
    queries_per_kv = plan.num_heads // plan.num_kv_heads
    constexprs = dict(
        QUERIES_PER_KV=queries_per_kv,
        HEAD_GROUPS=triton.cdiv(queries_per_kv, cfg.heads_per_prog),
        HEADS_PER_PROG=cfg.heads_per_prog,
        BLOCK_Q=cfg.block_q,
        BLOCK_N=cfg.block_n,
        HEAD_DIM=plan.head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        HAS_TILE_MAP=has_map,
        SPLIT=splits > 1,
        FP32_DOT=q.dtype == torch.float32,
    )
    if plan.sliding_window is not None:  # absent otherwise: the kernel's defaults, no window
        constexprs["WINDOW"] = plan.sliding_window
    if cap_log2:
        constexprs["SOFT_CAP_LOG2"] = cap_log2
    if is_fp8(kv_cache.dtype):
        constexprs["KV_FP8"] = True
        if fp8_convert.ENABLED:  # K/V read as int16 pairs (`pagellm.kernels.fp8_convert`)
            constexprs["FP8_PAIRS"] = 1 if kv_cache.dtype == torch.float8_e4m3fn else 2
            constexprs["PTX_CVT"] = kv_cache.device.type == "cuda"  # the interpreter: no PTX
    if pdl.enabled(q.device):
        constexprs["PDL"] = True
    return constexprs


# (config, (q dtype, cache dtype), head_dim, block_size) -> num_stages that fit the GPU's
# shared memory
_STAGES_THAT_FIT: dict[tuple, int] = {}


def _launch_fitting(grid, args, constexprs, cfg: TileConfig, dtypes: tuple) -> None:
    """Launch with cfg.num_stages, or fewer where the GPU has less shared memory than an H200
    (fp32, or a smaller GPU); the count that fits is remembered."""
    key = (cfg, dtypes, constexprs["HEAD_DIM"], constexprs["BLOCK_SIZE"])
    stages = _STAGES_THAT_FIT.get(key, cfg.num_stages)
    while True:
        try:
            _paged_attention_kernel[grid](
                *args, **constexprs, num_warps=cfg.num_warps, num_stages=stages
            )
            _STAGES_THAT_FIT[key] = stages
            return
        except OutOfResources:
            if stages == 1:
                raise
            stages -= 1
