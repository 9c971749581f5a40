"""Triton int4 / int8 weight-only GEMMs (W4A16, W8A16) on CUDA: y = x @ w^T (+ bias),
w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], g = k // GROUP, never written to memory.

The weight is `pagellm/quantization/wna16_formats.py`'s canonical layout: q uint8 [N, K / 2]
(4-bit; byte j holds k = 2j in its low nibble, 2j + 1 in its high one) or [N, K] (8-bit),
scales float32 [N, G], zeros uint8 [N, G]; an act-order layer's columns were sorted by group
at load (its caller gathers x).

    _wna16_gemv_kernel  M rows (decode, M <= GEMV_MAX_ROWS), one program per BLOCK_N outputs
                        and row: the packed bytes streamed once, low and high nibbles dotted
                        with x's even and odd columns in float32 on the CUDA cores; a group's
                        zero applied once a group (scale * (q . x - zero * sum x)); a K step
                        lies in one group or holds whole groups (`gemv_config`)
    _wna16_gemm_kernel  more rows: [BLOCK_M, BLOCK_K] x tiles against [BLOCK_K, BLOCK_N]
                        weight tiles unpacked and scaled in registers into x's dtype
                        (bf16 / fp16), then tl.dot on the tensor cores, float32 accumulation

The GEMM's BLOCK_K divides GROUP (a K step stays in one group), so each step reads one scale
and zero a column. Both are CUDA-graph safe (no host syncs, shapes fixed by the launch).
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
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEP_GROUPS: tl.constexpr,
):  # fmt: skip
    pid_n, row = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    x_row = x_ptr + row * stride_xm
    for k0 in range(0, K, BLOCK_K):
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
            prod = lo * xe[None, :] + hi * xo[None, :]  # [BLOCK_N, BLOCK_K / 2]
            xs = xe + xo
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            qv = tl.load(
                q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :],
                mask=n_mask[:, None] & k_mask[None, :],
                other=0,
            ).to(tl.float32)
            xv = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            prod = qv * xv[None, :]
            xs = xv
        acc += _grouped_sum(prod, xs, s_ptr, z_ptr, offs_n, n_mask, k0, G, GROUP, BLOCK_N,
                            STEP_GROUPS)  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _grouped_sum(prod, xs, s_ptr, z_ptr, offs_n, n_mask, k0, G, GROUP: tl.constexpr,
                 BLOCK_N: tl.constexpr, STEP_GROUPS: tl.constexpr):  # fmt: skip
    """One K step's [BLOCK_N] contribution: per group g of the step, scale * (q . x - zero *
    sum x), from the products q * x [BLOCK_N, W] and x's sums xs [W] (W columns, or bytes of
    two columns, in STEP_GROUPS groups of equal width)."""
    g = k0 // GROUP
    if STEP_GROUPS == 1:
        scale = tl.load(s_ptr + offs_n * G + g, mask=n_mask, other=0.0)
        zero = tl.load(z_ptr + offs_n * G + g, mask=n_mask, other=0).to(tl.float32)
        return scale * (tl.sum(prod, axis=1) - zero * tl.sum(xs, axis=0))
    width: tl.constexpr = prod.shape[1] // STEP_GROUPS
    dots = tl.sum(tl.reshape(prod, (BLOCK_N, STEP_GROUPS, width)), axis=2)  # [BLOCK_N, S]
    sums = tl.sum(tl.reshape(xs, (STEP_GROUPS, width)), axis=1)  # [S]
    gs = g + tl.arange(0, STEP_GROUPS)
    mask = n_mask[:, None] & (gs < G)[None, :]
    offs = offs_n[:, None] * G + gs[None, :]
    scale = tl.load(s_ptr + offs, mask=mask, other=0.0)
    zero = tl.load(z_ptr + offs, mask=mask, other=0).to(tl.float32)
    return tl.sum(scale * (dots - zero * sums[None, :]), axis=1)


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


def gemv_config(k: int, bits: int, group: int) -> dict:
    """The GEMV's tiles (decode rows): 16 output rows a program, a K step of 256 columns
    (4-bit) or 128 (8-bit) within one group, 4 warps. `config=` overrides them, and a K step
    may then hold several whole groups (BLOCK_K a multiple of GROUP):
    `benchmarks/wna16.py --sweep` times the candidates."""
    return {"BLOCK_N": 16, "BLOCK_K": block_k(group, 256 if bits == 4 else 128), "num_warps": 4}


def wna16_gemm(
    x: torch.Tensor,  # [M, K] bf16 / fp16 (float32 in the interpreter)
    qweight: torch.Tensor,  # [N, K * bits / 8] uint8
    scales: torch.Tensor,  # [N, G] float32
    zeros: torch.Tensor,  # [N, G] uint8
    bits: int,
    group: int,  # inputs a group (K for one group)
    bias: torch.Tensor | None = None,  # [N]
    config: dict | None = None,  # the GEMV's tiles (M <= GEMV_MAX_ROWS): see gemv_config
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
        cfg = dict(config or gemv_config(k, bits, group))
        steps = _step_groups(cfg["BLOCK_K"], group)
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), m)
        _wna16_gemv_kernel[grid](
            *common, n, k, g, x.stride(0), qweight.stride(0), y.stride(0),
            BITS=bits, GROUP=group, HAS_BIAS=bias is not None, STEP_GROUPS=steps, **cfg,
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


def _step_groups(step: int, group: int) -> int:
    """Whole groups in a GEMV K step of `step` columns (1: the step lies inside one group)."""
    if group % step == 0:
        return 1
    if step % group or (step // group) & (step // group - 1):
        raise ValueError(f"wna16_gemm: a K step of {step} neither divides the group size "
                         f"{group} nor holds a power of two of whole groups")  # fmt: skip
    return step // group
