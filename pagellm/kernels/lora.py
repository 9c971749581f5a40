"""Multi-LoRA shrink and expand (Triton), punica's two halves of `x @ A^T @ B^T * scale`.

A step's token rows are grouped by the slot of their adapter (`rows_by_slot`): `rows` [T]
int32 lists the rows of slot 0, then of slot 1, ... (rows without an adapter are left out),
and `starts` [L + 1] int32 says where each slot's run begins. Program (m, s) of the grid takes
the m-th block of BLOCK_M rows of slot s's run (a block past its end returns at once), so
each row is read and written by one program, and a block of rows shares one adapter's A or
B tile. The grid depends on T and max_loras only, and no value is read back to the host, so
a CUDA graph replays it for any mix of adapters.

    shrink  h[t, :P*R]            = (x[t] @ A[s]^T) * scale[s]   A: [max_loras, P * R, in]
    expand  out[t, lo:lo + N]   += h[t, p*R:(p+1)*R] @ B[s, c]^T  B: [max_loras, N, R]
                                    (c an output column of part p)

A fused projection (q | k | v, gate | up: P parts) takes one shrink and one expand: its
parts' A stacked along the rank (the parts read the same x, once), its parts' B along the
output columns, which part p's columns [ends[p - 1], ends[p]) of B take h's p-th R columns.
Ranks below R are zero-padded in the slots, so R (max_lora_rank) is every adapter's width.
`h` is float32 and holds values only in the rows that have an adapter; `out` is updated in
place. The shrink's K loop takes long steps (up to 256 columns): a decode step's few rows
per adapter leave few programs, each as long as its loop; ranks beyond 64 take more programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kernels.lora_cpu import rows_by_slot  # noqa: F401 (the grouping the kernels take)

MAX_PARTS = 3  # q | k | v


@triton.jit
def _slot_block(rows_ptr, starts_ptr, pid_m, slot, BLOCK_M: tl.constexpr):
    """Block pid_m of slot's rows: (row indices, which of them exist, any at all)."""
    start = tl.load(starts_ptr + slot)
    count = tl.load(starts_ptr + slot + 1) - start
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = offs < count
    rows = tl.load(rows_ptr + start + offs, mask=ok, other=0)
    return rows, ok, pid_m * BLOCK_M < count


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, rows_ptr, starts_ptr, scale_ptr, K, R,
    stride_xt, stride_al, stride_ar, stride_ht,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m, slot, pid_r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, mine, any_rows = _slot_block(rows_ptr, starts_ptr, pid_m, slot, BLOCK_M)
    if not any_rows:
        return
    ranks = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xt + ks[None, :],
                    mask=mine[:, None] & (ks[None, :] < K), other=0.0)  # fmt: skip
        a = tl.load(a_ptr + slot * stride_al + ranks[None, :] * stride_ar + ks[:, None],
                    mask=(ranks[None, :] < R) & (ks[:, None] < K), other=0.0)  # fmt: skip
        if IEEE:  # a float32 model: float32 products (not TF32), as HF + PEFT's
            acc += tl.dot(x, a, input_precision="ieee")
        else:  # bf16 / fp16: exact products, float32 sums
            acc += tl.dot(x, a)  # [M, K] @ [K, R]
    acc *= tl.load(scale_ptr + slot)
    tl.store(h_ptr + rows[:, None] * stride_ht + ranks[None, :], acc,
             mask=mine[:, None] & (ranks[None, :] < R))  # fmt: skip


@triton.jit
def _part_bounds(p: tl.constexpr, PARTS: tl.constexpr, N, end0, end1):
    """Part p's output columns [lo, hi) of B, from the parts' ends (the last one's is N)."""
    if p == 0:
        lo = 0
    elif p == 1:
        lo = end0
    else:
        lo = end1
    if p == PARTS - 1:
        hi = N
    elif p == 0:
        hi = end0
    else:
        hi = end1
    return lo, hi


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, out_ptr, rows_ptr, starts_ptr, N, R, col0, end0, end1,
    stride_ht, stride_bl, stride_bn, stride_ot,
    PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, mine, any_rows = _slot_block(rows_ptr, starts_ptr, pid_m, slot, BLOCK_M)
    if not any_rows:
        return
    c0 = pid_n * BLOCK_N
    cols = c0 + tl.arange(0, BLOCK_N)
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for p in tl.static_range(PARTS):  # a block of columns within one part: one dot
        lo, hi = _part_bounds(p, PARTS, N, end0, end1)
        if (c0 < hi) & (c0 + BLOCK_N > lo):
            in_part = (cols >= lo) & (cols < hi)
            for r0 in range(0, R, BLOCK_R):
                ranks = r0 + tl.arange(0, BLOCK_R)
                h = tl.load(h_ptr + rows[:, None] * stride_ht + p * R + ranks[None, :],
                            mask=mine[:, None] & (ranks[None, :] < R), other=0.0)  # fmt: skip
                b = tl.load(b_ptr + slot * stride_bl + cols[None, :] * stride_bn + ranks[:, None],
                            mask=in_part[None, :] & (ranks[:, None] < R), other=0.0)  # fmt: skip
                if IEEE:
                    delta += tl.dot(h, b.to(tl.float32), input_precision="ieee")  # [M, R] @ [R, N]
                else:
                    delta += tl.dot(h, b.to(tl.float32))
    out_ptrs = out_ptr + rows[:, None] * stride_ot + col0 + cols[None, :]
    keep = mine[:, None] & (cols[None, :] < N)
    out = tl.load(out_ptrs, mask=keep, other=0.0)
    tl.store(out_ptrs, (out.to(tl.float32) + delta).to(out.dtype), mask=keep)


def _block_r(rank: int) -> int:
    return min(64, max(16, triton.next_power_of_2(rank)))


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    scales: torch.Tensor,
) -> torch.Tensor:
    """h [T, P * R] float32 = (x @ A[slot]^T) * scale[slot] for each row that has a slot (the
    other rows of h are left unset). x [T, in] (rows contiguous), a [L, P * R, in]
    rows contiguous (a fused projection's parts stacked along the rank), rows [>= T] and starts
    [L + 1] int32 from `rows_by_slot`, scales [L]."""
    t, k = x.shape
    num_slots, r, k_a = a.shape
    assert k_a == k and a.stride(2) == 1 and x.stride(1) == 1, (x.shape, a.shape)
    assert rows.shape[0] >= t and starts.shape == (num_slots + 1,) and scales.shape == (num_slots,)
    h = torch.empty(t, r, device=x.device, dtype=torch.float32)
    if t == 0:
        return h
    block_m, block_r = 16, _block_r(r)
    grid = (triton.cdiv(t, block_m), num_slots, triton.cdiv(r, block_r))
    _shrink_kernel[grid](
        x, a, h, rows, starts, scales, k, r, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        BLOCK_M=block_m, BLOCK_K=min(256, max(16, triton.next_power_of_2(k))),
        BLOCK_R=block_r, IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return h


def lora_expand(
    h: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
    out: torch.Tensor, col0: int = 0, ends: tuple[int, ...] | None = None,
) -> torch.Tensor:  # fmt: skip
    """out[:, col0:col0 + N] += h_p @ B[slot, part p's columns]^T for each row with a slot (in
    place; returned). h [T, P * R] float32 (`lora_shrink`'s), b [L, N, R] (ranks contiguous), rows /
    starts as `lora_shrink` takes them, out [T, >= col0 + N] (rows contiguous); `ends`: each
    part's last column + 1 in B (None: one part, N)."""
    t, pr = h.shape
    num_slots, n, r = b.shape
    ends = tuple(ends or (n,))
    parts = len(ends)
    assert 1 <= parts <= MAX_PARTS and ends[-1] == n and list(ends) == sorted(ends), ends
    assert pr == parts * r and b.stride(2) == 1 and out.stride(1) == 1, (h.shape, b.shape)
    assert out.shape[0] == t and out.shape[1] >= col0 + n and starts.shape == (num_slots + 1,)
    if t == 0:
        return out
    block_m, block_n = 16, 64
    grid = (triton.cdiv(t, block_m), triton.cdiv(n, block_n), num_slots)
    inner = (ends + (n, n))[: MAX_PARTS - 1]  # the first parts' ends (unused ones: N)
    _expand_kernel[grid](
        h, b, out, rows, starts, n, r, col0, *inner, h.stride(0), b.stride(0), b.stride(1),
        out.stride(0), PARTS=parts, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=_block_r(r),
        IEEE=out.dtype == torch.float32,
    )  # fmt: skip
    return out
