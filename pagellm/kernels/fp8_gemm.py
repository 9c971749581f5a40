"""Triton fp8 (e4m3) GEMMs for `quantization="fp8"`: y = x @ dequant(w)^T (+ bias).

Weights are float8_e4m3fn [N, K] (row-major, K contiguous) with float32 scales, either one per
output row (`w_scale` [N]; per-tensor checkpoints are expanded to it) or one per 128x128 block
(`w_scale` [ceil(N / 128), ceil(K / 128)], DeepSeek-V3 / Qwen3-FP8's `weight_scale_inv`).

    fp8_gemm(x bf16, w, w_scale)          weight-only: w tiles are upcast in registers
                                          (decode sizes: the GEMM streams the weight; no
                                          activation rounding, no extra kernel)
    fp8_gemm(xq fp8, w, w_scale, x_scale) w8a8: x quantized per token (per-channel w) or per
                                          (token, 128 columns) (block w) by `quantize_fp8`,
                                          or by the op before the GEMM (`fused.rms_norm_fp8`,
                                          `fused.silu_and_mul_fp8`: the same scales)

One tl.dot kernel serves both (`A_FP8`), with the block scales applied per 128-wide K step.
Each program computes a BLOCK_M x BLOCK_N tile of y, walking K; at decode sizes (BLOCK_N
small, one M tile) the grid is N / BLOCK_N programs, each streaming BLOCK_N weight rows.
Weight-only, w is read as int16 pairs and converted to fp16 before the MMA layout change
(`fp8_convert`: 1.2-1.3x over a plain `.to()` at 2-16 rows). One row of x (batch 1) takes
`_fp8_gemv_kernel` instead: no tensor cores, two weight rows a program, 2.85-4.1 TB/s of
weight on an H200 where the tl.dot kernel reached 1.2-2.7 (docs/notes.md); with
`gated=True` a gate | up weight's GEMV pairs gate row j with up row j in a program and
returns silu(gate) * up, the SiLU-and-mul kernel fused into its epilogue; `fp8_gemv_qkv`
(`_fp8_gemv_qkv_kernel`) is the q | k | v GEMV of one token with rotary and the KV-cache
write in its epilogue, so that attention follows it directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kernels import fp8_convert, pdl
from pagellm.kernels.fp8_convert import fp8_pairs_to_f16, load_fp8_pairs
from pagellm.kernels.fused import fp8_scale, rotate_halves, to_fp8
from pagellm.kernels.reshape_and_cache import quant_args, slot_offset, to_cache

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
SCALE_BLOCK = 128  # rows and columns of one block scale


@triton.jit
def _quantize_kernel(
    x_ptr,  # [M, K] bf16 / fp16 / fp32
    q_ptr,  # [M, K] fp8
    s_ptr,  # [M, K / GROUP] float32
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per (row, group): scale = amax / 448, q = x / scale
    row = tl.program_id(0)
    start = tl.program_id(1) * GROUP
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for off in range(0, GROUP, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        mask = (off + tl.arange(0, BLOCK) < GROUP) & (cols < K)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = fp8_scale(tl.max(amax, axis=0))
    for off in range(0, GROUP, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        mask = (off + tl.arange(0, BLOCK) < GROUP) & (cols < K)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(
            q_ptr + row * stride_qm + cols, to_fp8(x, scale, q_ptr.dtype.element_ty), mask=mask
        )
    tl.store(s_ptr + row * stride_sm + tl.program_id(1), scale)


def quantize_fp8(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic fp8 quantization of x [M, K] per row (`group` None) or per (row, `group`
    columns): (q fp8 [M, K], scale float32 [M, K / group]) with x ~ q * scale."""
    m, k = x.shape
    group = group or k
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        block = min(triton.next_power_of_2(group), 1024)
        _quantize_kernel[(m, groups)](
            x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0), GROUP=group, BLOCK=block
        )
    return q, scale


@triton.jit
def _gemm_step(acc, a_ptrs, w_ptrs, w_ptr, w_rows, a_scale_ptr, w_scale_ptr, rm, rn, m_ok, n_ok,
               k0, stride_asm, stride_wsn, A_FP8: tl.constexpr, W_BLOCK: tl.constexpr,
               BLOCK_K: tl.constexpr, W_PAIRS: tl.constexpr, PTX_CVT: tl.constexpr):  # fmt: skip
    """acc [BLOCK_M, BLOCK_N] + one K step: the x tile at `a_ptrs` [BLOCK_M, BLOCK_K] times the
    weight tile's transpose, fp8 by fp8 (A_FP8) or the weight upcast to x's dtype in
    registers (W_PAIRS: through int16 pairs, before the MMA layout change); block scales
    (W_BLOCK) multiply each step's product, per-row scales wait for the epilogue."""
    a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
    if A_FP8:
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        part = tl.dot(a, tl.trans(w))
    else:
        if W_PAIRS:
            w = fp8_pairs_to_f16(load_fp8_pairs(w_ptr, w_rows + k0, n_ok, BLOCK_K), 1, PTX_CVT)
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        part = tl.dot(a, tl.trans(w.to(a.dtype)))
    if W_BLOCK:
        kb = k0 // W_BLOCK
        ws = tl.load(w_scale_ptr + (rn // W_BLOCK) * stride_wsn + kb, mask=n_ok, other=0.0)
        if A_FP8:
            xs = tl.load(a_scale_ptr + rm * stride_asm + kb, mask=m_ok, other=0.0)
            part = part * xs[:, None]
        acc += part * ws[None, :]
    else:
        acc += part
    return acc


@triton.jit
def _gemm_store(acc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, rm, rn, m_ok, n_ok, stride_asm,
                stride_cm, A_FP8: tl.constexpr, W_BLOCK: tl.constexpr,
                HAS_BIAS: tl.constexpr):  # fmt: skip
    """The epilogue: per-row scales (weight rows', and x rows' with A_FP8: once, not per K
    step), bias, the tile stored in c's dtype."""
    if not W_BLOCK:
        acc = acc * tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
        if A_FP8:
            acc = acc * tl.load(a_scale_ptr + rm * stride_asm, mask=m_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,  # [M, K] bf16 (weight-only) or fp8 (A_FP8)
    a_scale_ptr,  # A_FP8: [M, K / 128] (block) or [M, 1] float32
    w_ptr,  # [N, K] fp8
    w_scale_ptr,  # [N] or [N / 128, K / 128] float32
    bias_ptr,  # [N]
    c_ptr,  # [M, N]
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_wn,
    stride_wsn,
    stride_cm,
    A_FP8: tl.constexpr,
    W_BLOCK: tl.constexpr,  # 0: per-row scales; 128: block scales (BLOCK_K == 128)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_PAIRS: tl.constexpr = False,  # weight-only: w read as int16 pairs (`fp8_convert`)
    PTX_CVT: tl.constexpr = False,  # W_PAIRS converted by PTX (compiled; not interpreted)
):
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    w_rows = rn.to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (checked by the wrapper)
        acc = _gemm_step(acc, a_ptrs, w_ptrs, w_ptr, w_rows, a_scale_ptr, w_scale_ptr, rm, rn,
                         m_ok, n_ok, k0, stride_asm, stride_wsn, A_FP8, W_BLOCK, BLOCK_K, W_PAIRS,
                         PTX_CVT)  # fmt: skip
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _gemm_store(acc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, rm, rn, m_ok, n_ok, stride_asm,
                stride_cm, A_FP8, W_BLOCK, HAS_BIAS)  # fmt: skip


@triton.jit
def _gemv_step(acc, w_ptrs, x_ptrs, w_scale_ptr, rn, n_ok, k0, stride_wsn, W_BLOCK: tl.constexpr,
               VEC: tl.constexpr):  # fmt: skip
    """acc + one K step of the GEMV: the fp8 weight tile at `w_ptrs` [BLOCK_N, BLOCK_K] times
    x at `x_ptrs` [1, BLOCK_K], each lane's VEC adjacent products summed in its registers."""
    w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
    x = tl.load(x_ptrs).to(tl.float32)
    prod = w.to(tl.float32) * x
    part = tl.sum(tl.reshape(prod, (prod.shape[0], prod.shape[1] // VEC, VEC)), axis=2)
    if W_BLOCK:  # the scale of each lane's VEC columns (VEC divides W_BLOCK)
        cols = k0 + tl.arange(0, prod.shape[1] // VEC) * VEC
        ws = tl.load(w_scale_ptr + (rn // W_BLOCK)[:, None] * stride_wsn
                     + (cols // W_BLOCK)[None, :], mask=n_ok[:, None], other=0.0)  # fmt: skip
        return acc + part * ws
    return acc + part


@triton.jit
def _gemv_rows(pid, N, span, BLOCK_N: tl.constexpr, PAIRED: tl.constexpr):
    """The weight rows of GEMV program `pid` and which exist: BLOCK_N adjacent rows, or where
    PAIRED BLOCK_N / 2 pairs (row i, row i + span), i running over the first halves of the
    2 * span-row groups of w: gate | up (span N / 2: gate row j beside up row j) or a q | k | v
    weight's heads (span head_dim / 2: the two halves rotary turns together)."""
    if PAIRED:
        half: tl.constexpr = BLOCK_N // 2
        lane = tl.arange(0, BLOCK_N)
        j = pid * half + lane % half  # the pair
        first = (j // span) * (2 * span) + j % span
        return first + (lane // half) * span, j < N // 2
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    return rn, rn < N


@triton.jit
def _pair_halves(out, PAIRS: tl.constexpr):
    """A paired program's [2 * PAIRS] results (firsts, then seconds) as two [PAIRS] vectors."""
    return tl.split(tl.permute(tl.reshape(out, (2, PAIRS)), (1, 0)))


@triton.jit
def _gemv_dot(x_ptr, w_ptr, w_scale_ptr, bias_ptr, rn, n_ok, K, stride_wn, stride_wsn,
              W_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr,
              PDL: tl.constexpr, VEC: tl.constexpr, K_STEPS: tl.constexpr):  # fmt: skip
    """x . w[rn] (+ bias[rn]) in float32, [BLOCK_N]: the GEMV's weight stream.

    BLOCK_K bytes of each of the rows a step, on the CUDA cores: fp8 -> f32 in registers,
    times x, each lane's products summed VEC at a time into a [BLOCK_N, BLOCK_K / VEC]
    accumulator, reduced across lanes once, after the loop. The weight is loaded VEC bytes
    at a time, the width of x's loads (VEC bf16 = 16 bytes), so both tiles have one register
    layout (loaded 16 bytes at a time, the weight tile was moved to x's layout through
    shared memory, with barriers, every step). With PDL the grid is launched while the
    kernel before it runs and waits for it before the loop: that hides the launch (+2.6% at
    batch 1); loading the first weight tile before the wait, as a peeled first step, cost
    7%; a one-step look-ahead in the loop cost 16%."""
    rk = tl.max_contiguous(tl.arange(0, BLOCK_K), VEC)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rk[None, :]
    acc = tl.zeros((rn.shape[0], BLOCK_K // VEC), dtype=tl.float32)
    pdl.wait_for_predecessor(PDL)  # x is the previous kernel's output
    if K_STEPS:
        for step in tl.static_range(K_STEPS):
            k0 = step * BLOCK_K
            acc = _gemv_step(acc, w_ptrs + k0, x_ptrs + k0, w_scale_ptr, rn, n_ok, k0, stride_wsn,
                             W_BLOCK, VEC)  # fmt: skip
    else:
        for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (checked by the wrapper)
            acc = _gemv_step(acc, w_ptrs, x_ptrs, w_scale_ptr, rn, n_ok, k0, stride_wsn, W_BLOCK,
                             VEC)  # fmt: skip
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    if not W_BLOCK:
        out = out * tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    return out


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [K] bf16 / fp16 / fp32: one activation row
    w_ptr,  # [N, K] fp8
    w_scale_ptr,  # [N] or [N / 128, K / 128] float32
    bias_ptr,  # [N]
    c_ptr,  # [N], or [N / 2] where GATED
    N,
    K,
    stride_wn,
    stride_wsn,
    W_BLOCK: tl.constexpr,  # 0: per-row scales; 128: block scales
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,  # launched early (`pagellm.kernels.pdl`): x only after the wait
    GATED: tl.constexpr = False,  # w is gate | up: c = silu(gate) * up (SiLU-and-mul fused)
    VEC: tl.constexpr = 8,  # weight bytes a lane loads at once (x: 2 VEC bytes of bf16)
    K_STEPS: tl.constexpr = 0,  # K / BLOCK_K where the loop is unrolled (0: a runtime loop)
):
    # One program streams BLOCK_N weight rows (`_gemv_dot`) and stores their outputs. A
    # plain GEMV lets the kernel after it launch now (RMSNorm after o_proj and down_proj:
    # one program, waiting); gate | up does not: the down GEMV's 2048 programs launched
    # early and waiting took gate_up's SM slots (-6% at batch 1).
    if not GATED:
        pdl.launch_dependents(PDL)
    pid = tl.program_id(0)
    rn, n_ok = _gemv_rows(pid, N, N // 2, BLOCK_N, GATED)
    out = _gemv_dot(x_ptr, w_ptr, w_scale_ptr, bias_ptr, rn, n_ok, K, stride_wn, stride_wsn,
                    W_BLOCK, HAS_BIAS, BLOCK_K, PDL, VEC, K_STEPS)  # fmt: skip
    dtype = c_ptr.dtype.element_ty
    if GATED:  # rounded where the unfused path rounds: the GEMM's output, then F.silu's
        PAIRS: tl.constexpr = BLOCK_N // 2
        gate, up = _pair_halves(out.to(dtype).to(tl.float32), PAIRS)
        act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        rj = pid * PAIRS + tl.arange(0, PAIRS)
        tl.store(c_ptr + rj, (act * up).to(dtype), mask=rj < N // 2)
    else:
        tl.store(c_ptr + rn, out.to(dtype), mask=n_ok)


@triton.jit
def _store_kv(first, second, head, d, ok, num_heads, num_kv_heads, k_cache_ptr, v_cache_ptr,
              slot_ptr, kv_scale_ptr, stride_cb, stride_cs, stride_ch, HALF_D: tl.constexpr,
              BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr,
              FP8_MAX: tl.constexpr):  # fmt: skip
    """The q | k | v GEMV's cache write: the pairs (first, second) [PAIRS] of k and v heads
    (`head` past num_heads) into the token's slot, as `reshape_and_cache` writes them
    (QUANT: by k_scale or v_scale into an fp8 cache); nothing for q's heads, nor for a
    padding token (slot -1)."""
    slot = tl.load(slot_ptr).to(tl.int64)
    kv = head - num_heads  # keys' heads, then values'
    is_v = kv >= num_kv_heads
    at = slot_offset(slot, BLOCK_SIZE, stride_cb, stride_cs)
    at += tl.where(is_v, kv - num_kv_heads, kv) * stride_ch + d
    kv_ok = ok & (kv >= 0) & (slot >= 0)
    scale_ptr = kv_scale_ptr + is_v.to(tl.int32)  # k_scale or v_scale, per value
    cache = k_cache_ptr.dtype.element_ty
    first_kv = to_cache(first, scale_ptr, cache, QUANT, FP8_MAX)
    second_kv = to_cache(second, scale_ptr, cache, QUANT, FP8_MAX)
    is_k = kv_ok & (kv < num_kv_heads)
    tl.store(k_cache_ptr + at, first_kv, mask=is_k)
    tl.store(k_cache_ptr + at + HALF_D, second_kv, mask=is_k)
    tl.store(v_cache_ptr + at, first_kv, mask=kv_ok & is_v)
    tl.store(v_cache_ptr + at + HALF_D, second_kv, mask=kv_ok & is_v)


@triton.jit
def _fp8_gemv_qkv_kernel(
    x_ptr,  # [K] bf16 / fp16: one activation row
    w_ptr,  # [N, K] fp8: q | k | v, N = (H + 2 H_kv) * 2 HALF_D
    w_scale_ptr,  # [N] or [N / 128, K / 128] float32
    bias_ptr,  # [N]
    cs_ptr,  # [2 HALF_D]: the token's cos | sin, in q's dtype
    q_ptr,  # [H, 2 HALF_D] out: q after rotary
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, H_kv, 2 HALF_D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, H_kv, 2 HALF_D]
    slot_ptr,  # [1]: the token's cache slot; -1: none (padding)
    kv_scale_ptr,  # [2] float32 k_scale, v_scale (QUANT only)
    N,
    K,
    stride_wn,
    stride_wsn,
    num_heads,
    num_kv_heads,
    stride_cb,  # cache strides between blocks, slots of a block, kv heads (elements)
    stride_cs,
    stride_ch,
    W_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HALF_D: tl.constexpr,  # head_dim / 2 (rotary over the whole head, NeoX halves)
    BLOCK_SIZE: tl.constexpr,  # of the paged cache
    QUANT: tl.constexpr = False,  # fp8 cache: divide by the scale, saturate, round
    FP8_MAX: tl.constexpr = 448.0,
    PDL: tl.constexpr = False,
    VEC: tl.constexpr = 8,
    K_STEPS: tl.constexpr = 0,
):
    # The q | k | v GEMV of one token with the two kernels after it in its epilogue: rotary
    # (`fused._rotary_kernel`) and the cache write (`reshape_and_cache`). A program's rows
    # are BLOCK_N / 2 pairs (d, d + HALF_D) of a head, which rotary turns together; q goes
    # to q_ptr, k and v into the token's cache slot. Rounded where the unfused path rounds:
    # the GEMM's output, the rotary's, then the fp8 cache's quantization.
    pid = tl.program_id(0)
    rn, n_ok = _gemv_rows(pid, N, HALF_D, BLOCK_N, True)
    out = _gemv_dot(x_ptr, w_ptr, w_scale_ptr, bias_ptr, rn, n_ok, K, stride_wn, stride_wsn,
                    W_BLOCK, HAS_BIAS, BLOCK_K, PDL, VEC, K_STEPS)  # fmt: skip
    dtype = q_ptr.dtype.element_ty
    PAIRS: tl.constexpr = BLOCK_N // 2
    a, b = _pair_halves(out.to(dtype).to(tl.float32), PAIRS)
    j = pid * PAIRS + tl.arange(0, PAIRS)
    head, d = j // HALF_D, j % HALF_D
    ok = j < N // 2
    turned_a, turned_b = rotate_halves(a, b, cs_ptr, d, HALF_D)
    turn = head < num_heads + num_kv_heads  # q and k heads; v passes
    first = tl.where(turn, turned_a, a).to(dtype)
    second = tl.where(turn, turned_b, b).to(dtype)
    is_q = ok & (head < num_heads)
    tl.store(q_ptr + head * (2 * HALF_D) + d, first, mask=is_q)
    tl.store(q_ptr + head * (2 * HALF_D) + HALF_D + d, second, mask=is_q)
    _store_kv(first, second, head, d, ok, num_heads, num_kv_heads, k_cache_ptr, v_cache_ptr,
              slot_ptr, kv_scale_ptr, stride_cb, stride_cs, stride_ch, HALF_D, BLOCK_SIZE, QUANT,
              FP8_MAX)  # fmt: skip


def gemv_config(n: int, k: int, block: int) -> dict:
    """Tiles of the one-row kernel: 2 weight rows a program, 512 bytes of each a step with
    one warp (16 bytes a lane) up to K = 8192, 2048 with 2 warps beyond; the K loop unrolled
    where it has at most 8 steps, so that a program's loads are all issued at once. From
    `benchmarks/gemm.py --fp8-sweep` at Llama-3.1-8B shapes on an H200 (docs/benchmarks.md):
    qkv 3.15, o 2.85, gate_up 4.09, down 3.67 TB/s of weight. Block scales alike: each
    lane's 8 columns take their 128-block's scale."""
    block_k, warps = (512, 1) if k <= 8192 else (2048, 2)
    while k % block_k:
        block_k //= 2
    steps = k // block_k
    return dict(GEMV=True, BLOCK_N=2, BLOCK_K=block_k, num_warps=warps, num_stages=1,
                K_STEPS=steps if steps <= 8 else 0)  # fmt: skip


def gemm_config(m: int, n: int, k: int, block: int) -> dict:
    """Tiles for one call. Decode sizes (m <= 16): one M tile of 16 and narrow N tiles, so
    that N / BLOCK_N programs each stream a few weight rows, 2 warps; wide N (gate_up): 32 x
    128 steps, 3 stages, else 16 x 512, 5 stages (`benchmarks/gemm.py --fp8-sweep --rows 16`,
    Llama-3.1-8B shapes, H200: 2.0-3.35 TB/s against 1.4-3.3 for 16 x 256 with 4 warps);
    larger m: 64 x 128 tiles. Block scales fix BLOCK_K at 128."""
    if m <= 16:
        wide = n >= 8192
        cfg = dict(BLOCK_M=16, BLOCK_N=32 if wide else 16, BLOCK_K=128 if wide else 512)
        cfg.update(num_warps=2, num_stages=3 if wide else 5)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)
    if block:
        cfg["BLOCK_K"] = block
    while k % cfg["BLOCK_K"]:
        cfg["BLOCK_K"] //= 2
    return cfg


def fp8_gemm(
    x: torch.Tensor,  # [M, K] bf16 / fp16 (weight-only) or fp8 (with x_scale)
    w: torch.Tensor,  # [N, K] fp8
    w_scale: torch.Tensor,  # [N] or [ceil(N / 128), ceil(K / 128)] float32
    bias: torch.Tensor | None = None,  # [N]
    x_scale: torch.Tensor | None = None,  # fp8 x: [M, 1] (per-row w) or [M, K / 128] (block w)
    out_dtype: torch.dtype = torch.bfloat16,
    config: dict | None = None,
    gated: bool = False,  # w is gate | up: returns silu(gate) * up [M, N / 2] (GEMV only)
) -> torch.Tensor:  # [M, N]
    m, k = x.shape
    n = w.shape[0]
    block = SCALE_BLOCK if w_scale.dim() == 2 else 0
    _check(x, w, w_scale, x_scale, block)
    if config is None and x_scale is None and m == 1:
        config = gemv_config(n, k, block)
    cfg = dict(config or gemm_config(m, n, k, block))
    if k % cfg["BLOCK_K"] or k % 16:
        raise ValueError(f"fp8_gemm: K={k} must be a multiple of 16 and of BLOCK_K")
    a_fp8 = x_scale is not None
    if cfg.pop("GEMV", False):  # one bf16 row: the CUDA-core kernel
        if a_fp8 or m != 1:
            raise ValueError("fp8_gemm: a GEMV config takes one bf16 / fp16 row of x")
        return _gemv(x, w, w_scale, bias, out_dtype, cfg, block, gated)
    if gated:
        raise ValueError("fp8_gemm: gate | up fused with SiLU-and-mul is a GEMV (one row) only")
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    if not a_fp8 and fp8_convert.ENABLED:
        cfg.update(W_PAIRS=True, PTX_CVT=w.device.type == "cuda")  # the interpreter: no PTX
    _fp8_gemm_kernel[grid](
        x, x_scale if a_fp8 else w_scale, w, w_scale, bias if bias is not None else w_scale, out,
        m, n, k, x.stride(0), x_scale.stride(0) if a_fp8 else 0, w.stride(0),
        w_scale.stride(0) if block else 0, out.stride(0),
        A_FP8=a_fp8, W_BLOCK=block, HAS_BIAS=bias is not None, **cfg,
    )  # fmt: skip
    return out


def _gemv(x, w, w_scale, bias, out_dtype, cfg: dict, block: int, gated: bool) -> torch.Tensor:
    """Launch `_fp8_gemv_kernel` on one row of x (K checked against `cfg` by the caller)."""
    n, k = w.shape
    if gated and n % 2:
        raise ValueError(f"fp8_gemm: a gate | up weight needs an even N, got {n}")
    out = torch.empty((1, n // 2 if gated else n), dtype=out_dtype, device=x.device)
    use_pdl = pdl.enabled(x.device)
    rows = cfg["BLOCK_N"] // 2 if gated else cfg["BLOCK_N"]  # outputs a program
    _fp8_gemv_kernel[(triton.cdiv(out.shape[1], rows),)](
        x, w, w_scale, bias if bias is not None else w_scale, out, n, k, w.stride(0),
        w_scale.stride(0) if block else 0, W_BLOCK=block, HAS_BIAS=bias is not None,
        PDL=use_pdl, launch_pdl=use_pdl, GATED=gated, **cfg,
    )  # fmt: skip
    return out


def fp8_gemv_qkv(
    x: torch.Tensor,  # [1, K] bf16 / fp16: one token
    w: torch.Tensor,  # [N, K] fp8: q | k | v, N = (num_heads + 2 num_kv_heads) * head_dim
    w_scale: torch.Tensor,  # [N] or [ceil(N / 128), ceil(K / 128)] float32
    bias: torch.Tensor | None,  # [N]
    cos_sin: torch.Tensor,  # [1, 1, head_dim]: the token's cos | sin (rotary over all of D)
    num_heads: int,
    num_kv_heads: int,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [1] int32 / int64; -1: write nothing
    kv_scale: torch.Tensor | None = None,  # [2] float32 k_scale, v_scale (fp8 caches; None: 1)
    config: dict | None = None,
) -> torch.Tensor:  # q [1, num_heads, head_dim] after rotary
    """The q | k | v projection of one token, rotary on q and k, and k and v written into
    the paged cache, in one kernel: `fused.rotary` and `reshape_and_cache` after the GEMV,
    bit for bit (batch-1 decode)."""
    n, k = w.shape
    d = kv_cache.shape[-1]
    block = SCALE_BLOCK if w_scale.dim() == 2 else 0
    _check(x, w, w_scale, None, block)
    if x.shape[0] != 1 or n != (num_heads + 2 * num_kv_heads) * d or d % 2:
        raise ValueError(f"fp8_gemv_qkv: x {tuple(x.shape)}, w {tuple(w.shape)} for "
                         f"{num_heads} + 2 x {num_kv_heads} heads of {d}")  # fmt: skip
    if kv_cache.dim() != 5 or kv_cache.shape[3] != num_kv_heads or kv_cache.stride(-1) != 1:
        raise ValueError(f"fp8_gemv_qkv: kv_cache {tuple(kv_cache.shape)}")
    if cos_sin.numel() != d or slot_mapping.numel() < 1:
        raise ValueError(f"fp8_gemv_qkv: cos_sin {tuple(cos_sin.shape)} for head_dim {d}")
    cfg = dict(config or gemv_config(n, k, block))
    cfg.pop("GEMV", None)
    if k % cfg["BLOCK_K"] or k % 16 or cfg["BLOCK_N"] % 2:
        raise ValueError(f"fp8_gemv_qkv: K={k} must be a multiple of 16 and of BLOCK_K, "
                         f"BLOCK_N even")  # fmt: skip
    q = torch.empty((1, num_heads, d), dtype=x.dtype, device=x.device)
    quant, kv_scale, fp8_max = quant_args(kv_cache, kv_scale)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    use_pdl = pdl.enabled(x.device)
    _fp8_gemv_qkv_kernel[(triton.cdiv(n // 2, cfg["BLOCK_N"] // 2),)](
        x, w, w_scale, bias if bias is not None else w_scale, cos_sin.contiguous(), q, k_cache,
        v_cache, slot_mapping, kv_scale if quant else w_scale, n, k, w.stride(0),
        w_scale.stride(0) if block else 0, num_heads, num_kv_heads, k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), W_BLOCK=block, HAS_BIAS=bias is not None,
        HALF_D=d // 2, BLOCK_SIZE=kv_cache.shape[2], QUANT=quant,
        FP8_MAX=fp8_max, PDL=use_pdl,
        launch_pdl=use_pdl, **cfg,
    )  # fmt: skip
    return q


def _check(x, w, w_scale, x_scale, block: int) -> None:
    if w.dtype != FP8 or w.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("fp8_gemm: w must be float8_e4m3fn; w and x contiguous along K")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"fp8_gemm: x {tuple(x.shape)} and w {tuple(w.shape)} differ in K")
    if (x_scale is None) != (x.dtype != FP8):
        raise ValueError("fp8_gemm: an fp8 x needs x_scale, a bf16 / fp16 x none")
    n, k = w.shape
    want = (triton.cdiv(n, block), triton.cdiv(k, block)) if block else (n,)
    if tuple(w_scale.shape) != want or w_scale.dtype != torch.float32:
        raise ValueError(f"fp8_gemm: w_scale must be float32 {want}, got {tuple(w_scale.shape)}")
