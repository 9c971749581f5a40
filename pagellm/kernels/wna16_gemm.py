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
                        (bf16 / fp16), then tl.dot on the tensor cores, float32 accumulation
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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 4  # above: the tensor-core GEMM
DEQUANT_MIN_ROWS = 1024  # from here on: the weight dequantized to a scratch buffer, then cuBLAS
MAGIC = tl.constexpr(8388608.0)  # 2^23: the float whose mantissa holds an unpacked value's bits


@triton.jit
def _unpack(words, col, BITS: tl.constexpr, PLACED: tl.constexpr):
    """[..., W] int32 words -> [..., W * 32 / BITS] float32: 2^23 + the value of column
    `col` (its index within the unpacked row, [W * 32 / BITS]). PLACED: value i of each
    16-bit half is left at its bit position (2^23 + q * 2^(BITS * (i % half)), no shift
    within the half) for a caller that scales x's columns to match."""
    v = tl.interleave(words, words)  # each word repeated in-thread, once per value
    v = tl.interleave(v, v)
    if BITS == 4:
        v = tl.interleave(v, v)
    per: tl.constexpr = 32 // BITS
    half: tl.constexpr = per // 2
    i = col % per
    if PLACED:
        bits = (v >> ((i // half) * 16)) & (((1 << BITS) - 1) << (BITS * (i % half)))
    else:
        bits = (v >> (BITS * i)) & ((1 << BITS) - 1)
    return (bits | 0x4B000000).to(tl.float32, bitcast=True)


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
               GROUP: tl.constexpr, SUB: tl.constexpr, STEPS: tl.constexpr):  # fmt: skip
    """One GEMV K step of rows offs_n: (values [BLOCK_N, STEPS * SUB] unpacked PLACED, minus
    2^23; scales and zeros [BLOCK_N, STEPS] of the sub-blocks' groups)."""
    per: tl.constexpr = 32 // BITS
    words = k0 // per + tl.arange(0, STEPS * SUB // per)
    qw = tl.load(q_ptr + offs_n[:, None] * stride_qn + words[None, :],
                 mask=n_mask[:, None] & (words < KW)[None, :], other=0)  # fmt: skip
    v = _unpack(qw, tl.arange(0, STEPS * SUB), BITS, True) - MAGIC
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
                                    BITS, GROUP, SUB, STEPS)  # fmt: skip
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
                    mask=m_mask[:, None] & (cols < K)[None, :], other=0.0)  # fmt: skip
        w = _dequant_tile(q_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, offs_k, KW, G, stride_qn,
                          BITS, GROUP)  # fmt: skip
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)  # w: [BLOCK_N, BLOCK_K]
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


def gemv_config(n: int, k: int, bits: int, group: int) -> dict:
    """The GEMV's tiles (decode rows): BLOCK_N outputs a program, a K step of BLOCK_K columns
    (sub-blocks of whole groups, or one group's part), num_warps. `config=` overrides them:
    `benchmarks/wna16.py --sweep` times the candidates. From its run on an H100 at
    Llama-3.1-8B's projections (2026-12-06): narrow layers (N <= 8192) want more programs
    (8 outputs each), long rows longer K steps."""
    block_k = 2048 if k >= 2048 else 1024
    return {"BLOCK_N": 8 if n <= 8192 else 16, "BLOCK_K": block_k, "num_warps": 4}


def gemm_config(m: int, n: int, k: int) -> dict:
    """The tensor-core GEMM's tiles for M rows (BLOCK_K is cut to divide the group); the
    sweep's best on an H100 at Llama-3.1-8B's projections: at M <= 16 a narrow layer's
    64-wide tiles leave SMs idle (4096 / 64 = 64 programs on 132 SMs)."""
    if m <= 16:
        block_n = 32 if n <= 4096 else 64
        return {"BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
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
            ROWS_PAD=triton.next_power_of_2(m), SUB=sub, STEPS=steps, **cfg,
        )  # fmt: skip
        return y
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if m >= DEQUANT_MIN_ROWS and config is None and not capturing:
        w = dequantize_into_scratch(words, scales, zeros, bits, group, k, x.dtype)
        return torch.nn.functional.linear(x, w, bias)
    cfg = dict(config or gemm_config(m, n, k))
    cfg["BLOCK_K"] = block_k(group, cfg["BLOCK_K"])
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _wna16_gemm_kernel[grid](
        *common, m, n, k, k * bits // 32, g, x.stride(0), words.stride(0), y.stride(0),
        BITS=bits, GROUP=group, HAS_BIAS=bias is not None, **cfg,
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
