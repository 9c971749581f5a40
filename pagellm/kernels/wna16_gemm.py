"""Triton int4 / int8 weight-only GEMMs (W4A16, W8A16) on CUDA: y = x @ w^T (+ bias),
w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], g = k // GROUP, never written to memory.

The weight is `pagellm/quantization/wna16_formats.py`'s canonical layout: q uint8 [N, K / 2]
(4-bit; byte j holds k = 2j in its low nibble, 2j + 1 in its high one) or [N, K] (8-bit),
scales float32 [N, G], zeros uint8 [N, G]; an act-order layer's columns were sorted by group
at load (its caller gathers x). The kernels read it as int32 words (a free view): word w of a
row holds columns 8w ... 8w + 7 (4-bit) or 4w ... 4w + 3 (8-bit), value i in bits
BITS * i ... BITS * i + BITS - 1.

    _wna16_gemv_kernel  M rows (decode, M <= GEMV_MAX_ROWS), one program per BLOCK_N outputs
                        for all rows: each K step loads [BLOCK_N, STEPS * SUB / values a word]
                        words at once (STEPS sub-blocks of SUB columns, each inside one
                        group), unpacks them once, dots them with each row of x on the CUDA
                        cores in float32, and applies a group's scale and zero once a row
                        (scale * (q . x - zero * sum x))
    _wna16_gemm_kernel  more rows: [BLOCK_M, BLOCK_K] x tiles against [BLOCK_K, BLOCK_N]
                        weight tiles unpacked and scaled in registers into x's dtype
                        (bf16 / fp16), then tl.dot on the tensor cores, float32 accumulation;
                        4-bit tiles of K steps >= 64 are built as 16-bit pairs (`_int4_pairs`)
    _wna16_dequant_kernel  M >= DEQUANT_MIN_ROWS (prefill): the weight dequantized once into
                        a scratch buffer and multiplied by cuBLAS (unpacking a weight once per
                        64-row tile costs more than the tensor cores' work at that size)

Unpacking never converts an integer to a float (I2F runs at a quarter of the FMA rate, which
bounded the first kernels at M = 1): a value's bits are OR-ed into the mantissa of 2^23
(0x4B000000), whose float is then 2^23 + value exactly (`_unpack`). The GEMV goes further:
values 0-3 of a word's low half (and of its high half, shifted down once) are masked in
place, so value i reads as q * 2^(BITS * (i % half)); x's column is scaled by the inverse
power of two (exact) and the dot is unchanged. Per int4 weight: one LOP3, an eighth of a
shift, one FADD and one FFMA. Both kernels are CUDA-graph safe (no host syncs, shapes fixed
by the launch).

The GEMM's 4-bit tiles go further (`_int4_pairs`): values j and j + 4 of a word sit 16 bits
apart, so one shift and one LOP3 place both in a bf16 (fp16) pair as 128 + q (1024 + q), and
one `sub` and one `mul` of bf16x2 (f16x2) make both (q - zero) * scale, the scale rounded to
x's dtype first (vLLM's Marlin also holds scales in x's dtype): the loop went from 7.75 to 4.8
sm_90 instructions a weight element (`benchmarks/kernel_sass.py wna16_gemm`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 4  # above: the tensor-core GEMM
DEQUANT_MIN_ROWS = 1024  # from here on: the weight dequantized to a scratch buffer, then cuBLAS
MAGIC = tl.constexpr(8388608.0)  # 2^23: the float whose mantissa holds an unpacked value's bits


@triton.jit
def _unpack(words, col, BITS: tl.constexpr, PLACED: tl.constexpr, PTX: tl.constexpr = False):
    """[..., W] int32 words -> [..., W * 32 / BITS] float32: 2^23 + the value of column
    `col` (its index within the unpacked row, [W * 32 / BITS]). PLACED: value i of each
    16-bit half is left at its bit position (2^23 + q * 2^(BITS * (i % half)), no shift
    within the half) for a caller that scales x's columns to match. PTX: the mask and the OR
    as one `lop3` (left to itself, ptxas spends two LOP3s: an instruction takes one
    immediate, and it does not move the magic into a register)."""
    v = tl.interleave(words, words)  # each word repeated in-thread, once per value
    v = tl.interleave(v, v)
    if BITS == 4:
        v = tl.interleave(v, v)
    per: tl.constexpr = 32 // BITS
    half: tl.constexpr = per // 2
    i = col % per
    if PLACED:
        v = v >> ((i // half) * 16)
        mask = ((1 << BITS) - 1) << (BITS * (i % half))
    else:
        v = v >> (BITS * i)
        mask = tl.full(i.shape, (1 << BITS) - 1, tl.int32)
    if PTX:
        bits = tl.inline_asm_elementwise(  # (a & b) | c
            "lop3.b32 $0, $1, $2, 0x4B000000, 0xEA;", "=r,r,r", [v, mask + tl.zeros_like(v)],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        bits = (v & mask) | 0x4B000000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _int4_pairs(words, zero, scale, dtype, PTX: tl.constexpr):
    """[BLOCK_N, W] int32 words of 4-bit values (value j of a word in bits 4j .. 4j + 3) ->
    [BLOCK_N, 8 W] (q - zero) * scale in `dtype` (bf16 or fp16), zero [BLOCK_N] int32, scale
    [BLOCK_N] float32. Values j and j + 4 sit 16 bits apart, so one shift and one LOP3 place
    both in the mantissas of a 16-bit pair: bf16 128 + q (fp16 1024 + q), exact. Minus the
    pair (128 + zero) is q - zero, exact; times the scale rounded to `dtype` is the one
    rounding (PTX: `sub` and `mul` of bf16x2 / f16x2, two values an instruction). The 8
    values of a word are then joined into its 8 columns in order (register moves)."""
    F16: tl.constexpr = dtype == tl.float16
    magic: tl.constexpr = 0x6400 if F16 else 0x4300
    zb = zero | magic
    sb = scale.to(dtype).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    zp = (zb | (zb << 16))[:, None] + tl.zeros_like(words)
    sp = (sb | (sb << 16))[:, None] + tl.zeros_like(words)
    if PTX:
        if F16:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                _PAIRS_F16, "=r,=r,=r,=r,r,r,r", [words, zp, sp], dtype=(tl.int32,) * 4,
                is_pure=True, pack=1)  # fmt: skip
        else:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                _PAIRS_BF16, "=r,=r,=r,=r,r,r,r", [words, zp, sp], dtype=(tl.int32,) * 4,
                is_pure=True, pack=1)  # fmt: skip
        v0, v4 = _halves(p0, dtype)
        v1, v5 = _halves(p1, dtype)
        v2, v6 = _halves(p2, dtype)
        v3, v7 = _halves(p3, dtype)
    else:  # the same bits, the pair's arithmetic in float32 (the interpreter)
        base = ((1024.0 if F16 else 128.0) + zero.to(tl.float32))[:, None]  # the magic's value
        s16 = scale.to(dtype).to(tl.float32)[:, None]
        v0, v4 = _halves_f32(words & 0x000F000F | (magic * 0x10001), base, s16, dtype)
        v1, v5 = _halves_f32((words >> 4) & 0x000F000F | (magic * 0x10001), base, s16, dtype)
        v2, v6 = _halves_f32((words >> 8) & 0x000F000F | (magic * 0x10001), base, s16, dtype)
        v3, v7 = _halves_f32((words >> 12) & 0x000F000F | (magic * 0x10001), base, s16, dtype)
    # [BLOCK_N, W, 2, 2, 2]: the first join's index is value j's bit 2, the last's bit 0
    value = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)),
                    tl.join(tl.join(v1, v5), tl.join(v3, v7)))  # fmt: skip
    return tl.reshape(value, (words.shape[0], 8 * words.shape[1]))


def _pairs_ptx(kind: str, magic: int) -> tl.constexpr:
    """`_int4_pairs`' four pairs of a word ($4; $5 the pair 128 + zero, $6 the scale's)."""
    shifts = "".join(f"shr.u32 t{i}, $4, {4 * i}; " for i in (1, 2, 3))
    # lop3 with LUT 0xEA: (a & b) | c
    place = "".join(f"lop3.b32 ${i}, {'$4' if i == 0 else f't{i}'}, 0x000F000F, {magic:#x}, 0xEA; "
                    for i in range(4))  # fmt: skip
    arith = "".join(f"sub.rn.{kind} ${i}, ${i}, $5; mul.rn.{kind} ${i}, ${i}, $6; "
                    for i in range(4))  # fmt: skip
    return tl.constexpr("{ .reg .b32 t1, t2, t3; " + shifts + place + arith + "}")


_PAIRS_BF16 = _pairs_ptx("bf16x2", 0x43004300)
_PAIRS_F16 = _pairs_ptx("f16x2", 0x64006400)


@triton.jit
def _halves(pair, dtype):
    """The two 16-bit values of an int32 register, as `dtype`."""
    lo = pair.to(tl.int16).to(dtype, bitcast=True)
    return lo, (pair >> 16).to(tl.int16).to(dtype, bitcast=True)


@triton.jit
def _halves_f32(pair, base, s16, dtype):
    """`_int4_pairs`' arithmetic on a pair of placed values, in float32."""
    lo, hi = _halves(pair, dtype)
    return (((lo.to(tl.float32) - base) * s16).to(dtype),
            ((hi.to(tl.float32) - base) * s16).to(dtype))  # fmt: skip


@triton.jit
def _dequant_tile(q_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, offs_k, KW, G, stride_qn,
                  BITS: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_K] float32 (q - zero) * scale of rows offs_n, columns k0 + offs_k (one
    group: BLOCK_K divides GROUP)."""
    words = k0 // (32 // BITS) + tl.arange(0, offs_k.shape[0] // (32 // BITS))
    qw = tl.load(q_ptr + offs_n[:, None] * stride_qn + words[None, :],
                 mask=n_mask[:, None] & (words < KW)[None, :], other=0)  # fmt: skip
    g = k0 // GROUP
    scale = tl.load(s_ptr + offs_n * G + g, mask=n_mask, other=0.0)
    zero = tl.load(z_ptr + offs_n * G + g, mask=n_mask, other=0).to(tl.float32)
    return (_unpack(qw, offs_k, BITS, False) - (MAGIC + zero[:, None])) * scale[:, None]


@triton.jit
def _gemv_tile(q_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, KW, G, stride_qn, BITS: tl.constexpr,
               GROUP: tl.constexpr, SUB: tl.constexpr, STEPS: tl.constexpr,
               PTX: tl.constexpr = False):  # fmt: skip
    """One GEMV K step of rows offs_n: (values [BLOCK_N, STEPS * SUB] unpacked PLACED, minus
    2^23; scales and zeros [BLOCK_N, STEPS] of the sub-blocks' groups)."""
    per: tl.constexpr = 32 // BITS
    words = k0 // per + tl.arange(0, STEPS * SUB // per)
    qw = tl.load(q_ptr + offs_n[:, None] * stride_qn + words[None, :],
                 mask=n_mask[:, None] & (words < KW)[None, :], other=0)  # fmt: skip
    v = _unpack(qw, tl.arange(0, STEPS * SUB), BITS, True, PTX) - MAGIC
    gs = (k0 + tl.arange(0, STEPS) * SUB) // GROUP
    mask = n_mask[:, None] & (gs < G)[None, :]
    offs = offs_n[:, None] * G + gs[None, :]
    scale = tl.load(s_ptr + offs, mask=mask, other=0.0)
    zero = tl.load(z_ptr + offs, mask=mask, other=0).to(tl.float32)
    return v, scale, zero


@triton.jit
def _gemv_row(v, scale, zero, x_row, k0, K, x_place, SUB: tl.constexpr, STEPS: tl.constexpr):
    """[BLOCK_N]: one row of x (`x_row`, columns k0 ...) dotted with a `_gemv_tile` step, each
    sub-block's scale and zero applied once (scale * (q . x - zero * sum x)); `x_place` the
    powers of two that undo PLACED."""
    cols = k0 + tl.arange(0, STEPS * SUB)
    xv = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
    prod = v * (xv * x_place)[None, :]
    if STEPS == 1:
        dots = tl.sum(prod, axis=1)[:, None]  # [BLOCK_N, 1]
        xsum = tl.sum(xv, axis=0)
    else:
        dots = tl.sum(tl.reshape(prod, (v.shape[0], STEPS, SUB)), axis=2)
        xsum = tl.sum(tl.reshape(xv, (STEPS, SUB)), axis=1)[None, :]
    return tl.sum(scale * (dots - zero * xsum), axis=1)


@triton.jit
def _wna16_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, y_ptr,
    N, K, KW, G, stride_xm, stride_qn, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
    ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, STEPS: tl.constexpr,
    PTX: tl.constexpr = False,
):  # fmt: skip
    pid_n = tl.program_id(0)
    per: tl.constexpr = 32 // BITS
    step: tl.constexpr = STEPS * SUB
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_c = tl.arange(0, step)
    offs_r = tl.arange(0, ROWS_PAD)
    # x's column c scaled by 2^-(BITS * place): matches the PLACED unpack (exact)
    x_place = tl.exp2(-(BITS * (offs_c % per % (per // 2))).to(tl.float32))
    acc = tl.zeros((ROWS_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, step):
        v, scale, zero = _gemv_tile(q_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, KW, G, stride_qn,
                                    BITS, GROUP, SUB, STEPS, PTX)  # fmt: skip
        for r in tl.static_range(ROWS):  # each row's dot with the same unpacked tile
            part = _gemv_row(v, scale, zero, x_ptr + r * stride_xm, k0, K, x_place, SUB, STEPS)
            acc += tl.where(offs_r[:, None] == r, part[None, :], 0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + offs_r[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(offs_r < ROWS)[:, None] & n_mask[None, :])


@triton.jit
def _wna16_gemm_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, y_ptr,
    M, N, K, KW, G, stride_xm, stride_qn, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PAIRS: tl.constexpr = False, PTX: tl.constexpr = False, EVEN_K: tl.constexpr = False,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :],
                    mask=m_mask[:, None] & ((cols < K) | EVEN_K)[None, :], other=0.0)  # fmt: skip
        if PAIRS:  # 4-bit, x in bf16 / fp16: built as 16-bit pairs
            words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            w_ok = (words < KW) | EVEN_K
            qw = tl.load(q_ptr + offs_n[:, None] * stride_qn + words[None, :],
                         mask=n_mask[:, None] & w_ok[None, :], other=0)  # fmt: skip
            g = k0 // GROUP
            scale = tl.load(s_ptr + offs_n * G + g, mask=n_mask, other=0.0)
            zero = tl.load(z_ptr + offs_n * G + g, mask=n_mask, other=0).to(tl.int32)
            w = _int4_pairs(qw, zero, scale, x.dtype, PTX)
        else:
            w = _dequant_tile(q_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, offs_k, KW, G, stride_qn,
                              BITS, GROUP).to(x.dtype)  # fmt: skip
        acc = tl.dot(x, tl.trans(w), acc)  # w: [BLOCK_N, BLOCK_K]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _wna16_dequant_kernel(
    q_ptr, s_ptr, z_ptr, w_ptr, N, K, KW, G, stride_qn, stride_wn,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """w[n, k] = (q - zero) * scale in w's dtype: the weight a many-row product hands to
    cuBLAS (BLOCK_K divides GROUP)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    k0 = pid_k * BLOCK_K
    w = _dequant_tile(q_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, offs_k, KW, G, stride_qn, BITS,
                      GROUP)  # fmt: skip
    cols = k0 + offs_k
    tl.store(w_ptr + offs_n[:, None] * stride_wn + cols[None, :], w.to(w_ptr.dtype.element_ty),
             mask=n_mask[:, None] & (cols < K)[None, :])  # fmt: skip


def block_k(group: int, wanted: int) -> int:
    """The K step: `wanted` or the largest power of two below it that divides the group."""
    step = wanted
    while step > 16 and group % step:
        step //= 2
    if group % step:
        raise ValueError(f"wna16: group size {group} is not a multiple of 16")
    return step


PAIRS_MIN_K = tl.constexpr(64)  # K steps of fewer columns (groups of 32) take the float32 unpack


def pairs_serve(bits: int, dtype: torch.dtype, step: int) -> bool:
    """Whether a tile of `step` columns is built as 16-bit pairs (`_int4_pairs`): 4-bit
    values under bf16 / fp16 x, K steps of at least PAIRS_MIN_K. Shorter steps (rows of 4
    words) broke Triton 3.6's dot-operand pass on sm_90 ("Illegal shared layout": it moved the
    tile's layout change up to the 16-byte word loads)."""
    return bits == 4 and dtype in (torch.bfloat16, torch.float16) and step >= PAIRS_MIN_K.value


def gemv_config(n: int, k: int, bits: int, group: int) -> dict:
    """The GEMV's tiles (decode rows): BLOCK_N outputs a program, a K step of BLOCK_K columns
    (sub-blocks of whole groups, or one group's part), num_warps. `config=` overrides them:
    `benchmarks/wna16.py --sweep` times the candidates. From its run on an H100 at
    Llama-3.1-8B's projections (2026-12-06): narrow layers (N <= 8192) want more programs
    (8 outputs each), long rows longer K steps."""
    block_k = 2048 if k >= 2048 else 1024
    return {"BLOCK_N": 8 if n <= 8192 else 16, "BLOCK_K": block_k, "num_warps": 4}


def gemm_config(m: int, n: int, k: int, pairs: bool = True) -> dict:
    """The tensor-core GEMM's tiles for M rows (BLOCK_K is cut to divide the group); the
    sweep's best on an H100 at Llama-3.1-8B's projections: at M <= 16 a narrow layer's
    64-wide tiles leave SMs idle (4096 / 64 = 64 programs on 132 SMs). From 128 rows (a
    decode step of many sequences) tiles built as 16-bit pairs (`pairs`) go taller, so each
    weight is built fewer times a step: at 256 rows 128-row tiles for N <= 4,096 (o, down),
    256-row ones above (qkv, gate_up), 0.461 -> 0.368 ms a layer (2026-12-07)."""
    if m <= 16:
        block_n = 32 if n <= 4096 else 64
        return {"BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    if pairs and m >= 256 and n > 4096:
        return {"BLOCK_M": 256, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    if pairs and m >= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4}
    block_n = 128 if n >= 16384 else 64
    return {"BLOCK_M": 64, "BLOCK_N": block_n, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}


def wna16_gemm(
    x: torch.Tensor,  # [M, K] bf16 / fp16 (float32 in the interpreter)
    qweight: torch.Tensor,  # [N, K * bits / 8] uint8
    scales: torch.Tensor,  # [N, G] float32
    zeros: torch.Tensor,  # [N, G] uint8
    bits: int,
    group: int,  # inputs a group (K for one group)
    bias: torch.Tensor | None = None,  # [N]
    config: dict | None = None,  # the tiles of the kernel M selects: gemv_config, gemm_config
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ w^T (+ bias) for an int weight in the canonical layout (see the module doc)."""
    m, k = x.shape
    n, g = scales.shape
    if (qweight.dtype != torch.uint8 or qweight.shape != (n, k * bits // 8)
            or zeros.shape != (n, g) or scales.dtype != torch.float32 or g != -(-k // group)
            or x.stride(1) != 1 or qweight.stride(1) != 1 or k % (32 // bits)):  # fmt: skip
        raise ValueError(
            f"wna16_gemm: x {tuple(x.shape)}, qweight {tuple(qweight.shape)} {qweight.dtype}, "
            f"scales {tuple(scales.shape)} {scales.dtype}, zeros {tuple(zeros.shape)}, "
            f"{bits}-bit groups of {group} (K a multiple of {32 // bits})"
        )
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    words = qweight.view(torch.int32)  # [N, K * bits / 32]
    common = (x, words, scales, zeros, bias if bias is not None else y, y)
    if m <= GEMV_MAX_ROWS:
        cfg = dict(config or gemv_config(n, k, bits, group))
        sub, steps = _sub_blocks(cfg.pop("BLOCK_K"), group, bits)
        grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
        _wna16_gemv_kernel[grid](
            *common, n, k, k * bits // 32, g, x.stride(0), words.stride(0), y.stride(0),
            BITS=bits, GROUP=group, HAS_BIAS=bias is not None, ROWS=m,
            ROWS_PAD=triton.next_power_of_2(m), SUB=sub, STEPS=steps, PTX=x.is_cuda, **cfg,
        )  # fmt: skip
        return y
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if m >= DEQUANT_MIN_ROWS and config is None and not capturing:
        w = dequantize_into_scratch(words, scales, zeros, bits, group, k, x.dtype)
        return torch.nn.functional.linear(x, w, bias)
    cfg = dict(config or gemm_config(m, n, k, pairs_serve(bits, x.dtype, block_k(group, 128))))
    cfg["BLOCK_K"] = block_k(group, cfg["BLOCK_K"])
    # PAIRS=False in a config takes the float32 unpack (benchmarks/wna16.py compares the two)
    pairs = cfg.pop("PAIRS", True) and pairs_serve(bits, x.dtype, cfg["BLOCK_K"])
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _wna16_gemm_kernel[grid](
        *common, m, n, k, k * bits // 32, g, x.stride(0), words.stride(0), y.stride(0),
        BITS=bits, GROUP=group, HAS_BIAS=bias is not None,
        PAIRS=pairs, PTX=x.is_cuda, EVEN_K=k % cfg["BLOCK_K"] == 0, **cfg,
    )  # fmt: skip
    return y


_SCRATCH: dict[tuple, torch.Tensor] = {}  # (device, dtype) -> the largest weight dequantized yet


def dequantize_into_scratch(words, scales, zeros, bits: int, group: int, k: int, dtype):
    """The [N, K] weight in `dtype`, written into a scratch buffer kept per device and dtype
    (grown to the largest layer: one buffer, reused by every layer of a prefill)."""
    n, g = scales.shape
    key = (words.device, dtype)
    if key not in _SCRATCH or _SCRATCH[key].numel() < n * k:
        _SCRATCH.pop(key, None)
        _SCRATCH[key] = torch.empty(n * k, dtype=dtype, device=words.device)
    w = _SCRATCH[key][: n * k].view(n, k)
    step = block_k(group, 128)
    grid = (triton.cdiv(n, 64), triton.cdiv(k, step))
    _wna16_dequant_kernel[grid](
        words, scales, zeros, w, n, k, k * bits // 32, g, words.stride(0), w.stride(0),
        BITS=bits, GROUP=group, BLOCK_N=64, BLOCK_K=step, num_warps=4,
    )  # fmt: skip
    return w


def _sub_blocks(step: int, group: int, bits: int) -> tuple[int, int]:
    """A GEMV K step of `step` columns (a power of two) as (SUB, STEPS): STEPS sub-blocks of
    SUB columns, SUB the largest power of two that divides the group (so a sub-block never
    straddles two groups), at most the step."""
    if step & (step - 1) or step < 32 // bits:
        raise ValueError(f"wna16_gemm: a K step of {step} is not a power of two of whole "
                         f"int32 words")  # fmt: skip
    sub = min(step, group & -group)
    if sub < 32 // bits:
        raise ValueError(f"wna16_gemm: groups of {group} do not hold whole int32 words")
    return sub, step // sub
