"""Triton int4 / int8 weight-only GEMMs (W4A16, W8A16) on CUDA: y = x @ w^T (+ bias),
w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], g = k // GROUP, never written to memory.

The weight is `pagellm/quantization/wna16_formats.py`'s canonical layout: q uint8 [N, K / 2]
(4-bit; byte j holds k = 2j in its low nibble, 2j + 1 in its high one) or [N, K] (8-bit),
scales float32 [N, G], zeros uint8 [N, G]; an act-order layer's columns were sorted by group
at load (its caller gathers x).

    _wna16_gemv_kernel  M rows (decode, M <= GEMV_MAX_ROWS), one program per BLOCK_N outputs
                        and row: the packed bytes streamed once, low and high nibbles dotted
                        with x's even and odd columns in float32 on the CUDA cores; a group's
                        zero applied once a K step (scale * (q . x - zero * sum x))
    _wna16_gemm_kernel  more rows: [BLOCK_M, BLOCK_K] x tiles against [BLOCK_K, BLOCK_N]
                        weight tiles unpacked and scaled in registers into x's dtype
                        (bf16 / fp16), then tl.dot on the tensor cores, float32 accumulation

BLOCK_K divides GROUP (a K step stays in one group), so each step reads one scale and zero a
column. Both are CUDA-graph safe (no host syncs, shapes fixed by the launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 4  # above: the tensor-core GEMM


@triton.jit
def _wna16_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, y_ptr,
    N, K, G, stride_xm, stride_qn, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n, row = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    x_row = x_ptr + row * stride_xm
    for k0 in range(0, K, BLOCK_K):
        g = k0 // GROUP
        scale = tl.load(s_ptr + offs_n * G + g, mask=n_mask, other=0.0)
        zero = tl.load(z_ptr + offs_n * G + g, mask=n_mask, other=0).to(tl.float32)
        if BITS == 4:
            offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # bytes: two columns each
            b_mask = offs_b < K // 2
            qb = tl.load(
                q_ptr + offs_n[:, None] * stride_qn + offs_b[None, :],
                mask=n_mask[:, None] & b_mask[None, :],
                other=0,
            ).to(tl.int32)
            xe = tl.load(x_row + 2 * offs_b, mask=b_mask, other=0.0).to(tl.float32)
            xo = tl.load(x_row + 2 * offs_b + 1, mask=b_mask, other=0.0).to(tl.float32)
            lo, hi = (qb & 15).to(tl.float32), (qb >> 4).to(tl.float32)
            dot = tl.sum(lo * xe[None, :] + hi * xo[None, :], axis=1)
            xsum = tl.sum(xe + xo, axis=0)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            qv = tl.load(
                q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :],
                mask=n_mask[:, None] & k_mask[None, :],
                other=0,
            ).to(tl.float32)
            xv = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            dot = tl.sum(qv * xv[None, :], axis=1)
            xsum = tl.sum(xv, axis=0)
        acc += scale * (dot - zero * xsum)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _wna16_gemm_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, y_ptr,
    M, N, K, G, stride_xm, stride_qn, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        w_mask = k_mask[:, None] & n_mask[None, :]
        if BITS == 4:  # [BLOCK_K, BLOCK_N]: each byte read for its two columns (cached)
            qb = tl.load(q_ptr + offs_n[None, :] * stride_qn + offs_k[:, None] // 2,
                         mask=w_mask, other=0).to(tl.int32)  # fmt: skip
            q = (qb >> ((offs_k[:, None] & 1) * 4)) & 15
        else:
            q = tl.load(q_ptr + offs_n[None, :] * stride_qn + offs_k[:, None],
                        mask=w_mask, other=0).to(tl.int32)  # fmt: skip
        g = k0 // GROUP
        scale = tl.load(s_ptr + offs_n * G + g, mask=n_mask, other=0.0)
        zero = tl.load(z_ptr + offs_n * G + g, mask=n_mask, other=0).to(tl.float32)
        w = ((q.to(tl.float32) - zero[None, :]) * scale[None, :]).to(x.dtype)
        acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def block_k(group: int, wanted: int) -> int:
    """The K step: `wanted` or the largest power of two below it that divides the group."""
    step = wanted
    while step > 16 and group % step:
        step //= 2
    if group % step:
        raise ValueError(f"wna16: group size {group} is not a multiple of 16")
    return step


def wna16_gemm(
    x: torch.Tensor,  # [M, K] bf16 / fp16 (float32 in the interpreter)
    qweight: torch.Tensor,  # [N, K * bits / 8] uint8
    scales: torch.Tensor,  # [N, G] float32
    zeros: torch.Tensor,  # [N, G] uint8
    bits: int,
    group: int,  # inputs a group (K for one group)
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ w^T (+ bias) for an int weight in the canonical layout (see the module doc)."""
    m, k = x.shape
    n, g = scales.shape
    if (qweight.dtype != torch.uint8 or qweight.shape != (n, k * bits // 8)
            or zeros.shape != (n, g) or scales.dtype != torch.float32 or g != -(-k // group)
            or x.stride(1) != 1 or qweight.stride(1) != 1):  # fmt: skip
        raise ValueError(
            f"wna16_gemm: x {tuple(x.shape)}, qweight {tuple(qweight.shape)} {qweight.dtype}, "
            f"scales {tuple(scales.shape)} {scales.dtype}, zeros {tuple(zeros.shape)}, "
            f"{bits}-bit groups of {group}"
        )
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bias_arg = bias if bias is not None else y
    common = (x, qweight, scales, zeros, bias_arg, y)
    if m <= GEMV_MAX_ROWS:
        step = block_k(group, 256 if bits == 4 else 128)
        grid = (triton.cdiv(n, 16), m)
        _wna16_gemv_kernel[grid](
            *common, n, k, g, x.stride(0), qweight.stride(0), y.stride(0),
            BITS=bits, GROUP=group, HAS_BIAS=bias is not None, BLOCK_N=16, BLOCK_K=step,
        )  # fmt: skip
        return y
    block_m = 16 if m <= 16 else 64
    step = block_k(group, 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _wna16_gemm_kernel[grid](
        *common, m, n, k, g, x.stride(0), qweight.stride(0), y.stride(0),
        BITS=bits, GROUP=group, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=64,
        BLOCK_K=step, num_warps=4, num_stages=3,
    )  # fmt: skip
    return y
