"""The fused-MoE GEMMs' epilogue (`fused_moe.py`, `fused_moe_quant.py`): the output rows
rounded where the torch path (`pagellm.layers.moe.experts_torch`) rounds, SiLU-and-mul for
the gate | up GEMM, the routing weight for the down GEMM; and gpt-oss's switches: the
expert's bias added to the accumulators (HAS_BIAS), its clamped SwiGLU in place of SiLU
(CLAMPED, `ClampedSwiGLU`'s alpha and limit as compile-time floats)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_rows(acc, acc_up, out_ptr, weights_ptr, rows, row_ok, offs_n, n_ok, n_out,
                GATED: tl.constexpr, APPLY_WEIGHTS: tl.constexpr):  # fmt: skip
    """The epilogue, rounded where the torch path rounds: the GEMM's output in out's dtype,
    GATED: SiLU(gate) * up, APPLY_WEIGHTS: times the row's routing weight; scattered to the
    rows' own places in out (`rows`, not the sorted order)."""
    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype).to(tl.float32)
    if GATED:
        act = (out * tl.sigmoid(out)).to(dtype).to(tl.float32)  # rounded, as F.silu returns it
        out = act * acc_up.to(dtype).to(tl.float32)
    if APPLY_WEIGHTS:
        out = out * tl.load(weights_ptr + rows, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + rows[:, None] * n_out + offs_n[None, :]
    tl.store(out_ptrs, out.to(dtype), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _store_epilogue(acc, acc_up, out_ptr, weights_ptr, bias_ptr, expert, stride_be, rows, row_ok,
                    offs_n, n_ok, n_out, GATED: tl.constexpr, APPLY_WEIGHTS: tl.constexpr,
                    HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, SWIGLU_ALPHA: tl.constexpr,
                    SWIGLU_LIMIT: tl.constexpr):  # fmt: skip
    """`_store_rows` after gpt-oss's steps where switched on: the expert's bias added to
    the accumulators (HAS_BIAS), the clamped SwiGLU in place of SiLU (CLAMPED)."""
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_be + offs_n
        acc += tl.load(bias_row, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_row + n_out, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if CLAMPED:
        acc = _clamped_swiglu(acc, acc_up, out_ptr.dtype.element_ty, SWIGLU_ALPHA, SWIGLU_LIMIT)
        _store_rows(acc, acc_up, out_ptr, weights_ptr, rows, row_ok, offs_n, n_ok, n_out, False,
                    APPLY_WEIGHTS)  # fmt: skip
    else:
        _store_rows(acc, acc_up, out_ptr, weights_ptr, rows, row_ok, offs_n, n_ok, n_out, GATED,
                    APPLY_WEIGHTS)  # fmt: skip


@triton.jit
def _clamped_swiglu(gate, up, dtype, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """gpt-oss's activation of float32 gate and up (rounded to `dtype` first, as the torch
    path's GEMM outputs are): (clamp(up) + 1) * g * sigmoid(ALPHA * g), g = min(gate, LIMIT)."""
    g = tl.minimum(gate.to(dtype).to(tl.float32), LIMIT)
    u = tl.minimum(tl.maximum(up.to(dtype).to(tl.float32), -LIMIT), LIMIT)
    return (u + 1.0) * (g * tl.sigmoid(ALPHA * g))


def gpt_oss_switches(bias: torch.Tensor | None, clamped: tuple[float, float] | None) -> dict:
    """The compile-time switches of a biased, clamped-SwiGLU GEMM (absent: the defaults)."""
    switches = {}
    if bias is not None:
        switches["HAS_BIAS"] = True
    if clamped is not None:
        alpha, limit = clamped
        switches.update(CLAMPED=True, SWIGLU_ALPHA=float(alpha), SWIGLU_LIMIT=float(limit))
    return switches
