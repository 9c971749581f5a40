"""Multi-LoRA shrink and expand (Triton), punica's two halves of `x @ A^T @ B^T * scale`.

Each token row carries a slot index (`token_slots` [T] int32; -1: no adapter). The grid has a
slot axis: program (m, s) takes a block of BLOCK_M rows and does the work of the rows whose
slot is s, the other rows masked (a block with none returns at once). The grid depends on T
and max_loras only, and no value is read back to the host, so a CUDA graph replays it for
any mix of adapters.

    shrink  h[t, :R]            = (x[t] @ A[s]^T) * scale[s]   A: [max_loras, R, in]
    expand  out[t, lo:lo + N]  += h[t] @ B[s]^T                B: [max_loras, N, R]

Ranks below R are zero-padded in the slots, so R (max_lora_rank) is every adapter's width.
`h` is float32; `out` is updated in place, each row by the one program of its slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, slots_ptr, scale_ptr, T, K, R,
    stride_xt, stride_al, stride_ar, stride_ht,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m, slot = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_slots = tl.load(slots_ptr + rows, mask=rows < T, other=-1)
    mine = row_slots == slot
    if tl.sum(mine.to(tl.int32)) == 0:
        return
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xt + ks[None, :],
                    mask=mine[:, None] & (ks[None, :] < K), other=0.0)  # fmt: skip
        a = tl.load(a_ptr + slot * stride_al + ranks[None, :] * stride_ar + ks[:, None],
                    mask=(ranks[None, :] < R) & (ks[:, None] < K), other=0.0)  # fmt: skip
        if IEEE:  # a float32 model: float32 products (not TF32), as HF + PEFT's
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32))  # [M, K] @ [K, R]
    acc *= tl.load(scale_ptr + slot)
    tl.store(h_ptr + rows[:, None] * stride_ht + ranks[None, :], acc,
             mask=mine[:, None] & (ranks[None, :] < R))  # fmt: skip


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, out_ptr, slots_ptr, T, N, R, col0,
    stride_ht, stride_bl, stride_bn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_slots = tl.load(slots_ptr + rows, mask=rows < T, other=-1)
    mine = row_slots == slot
    if tl.sum(mine.to(tl.int32)) == 0:
        return
    ranks = tl.arange(0, BLOCK_R)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.load(h_ptr + rows[:, None] * stride_ht + ranks[None, :],
                mask=mine[:, None] & (ranks[None, :] < R), other=0.0)  # fmt: skip
    b = tl.load(b_ptr + slot * stride_bl + cols[None, :] * stride_bn + ranks[:, None],
                mask=(cols[None, :] < N) & (ranks[:, None] < R), other=0.0)  # fmt: skip
    if IEEE:
        delta = tl.dot(h, b.to(tl.float32), input_precision="ieee")  # [M, R] @ [R, N]
    else:
        delta = tl.dot(h, b.to(tl.float32))
    out_ptrs = out_ptr + rows[:, None] * stride_ot + col0 + cols[None, :]
    keep = mine[:, None] & (cols[None, :] < N)
    out = tl.load(out_ptrs, mask=keep, other=0.0)
    tl.store(out_ptrs, (out.to(tl.float32) + delta).to(out.dtype), mask=keep)


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """h [T, R] float32 = (x @ A[slot]^T) * scale[slot] for each row (0 where slot is -1).
    x [T, in] (rows contiguous), a [L, R, in] contiguous, token_slots [T] int32, scales [L]."""
    t, k = x.shape
    num_slots, r, k_a = a.shape
    assert k_a == k and a.is_contiguous() and x.stride(1) == 1, (x.shape, a.shape)
    assert token_slots.shape == (t,) and scales.shape == (num_slots,)
    h = torch.zeros(t, r, device=x.device, dtype=torch.float32)
    if t == 0:
        return h
    block_m = 16
    grid = (triton.cdiv(t, block_m), num_slots)
    _shrink_kernel[grid](
        x, a, h, token_slots, scales, t, k, r, x.stride(0), a.stride(0), a.stride(1),
        h.stride(0), BLOCK_M=block_m, BLOCK_K=32, BLOCK_R=_block_r(r),
        IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return h


def lora_expand(
    h: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor, col0: int = 0
) -> torch.Tensor:
    """out[:, col0:col0 + N] += h @ B[slot]^T for each row with a slot (in place; returned).
    h [T, R] float32, b [L, N, R] contiguous, out [T, >= col0 + N] (rows contiguous)."""
    t, r = h.shape
    num_slots, n, r_b = b.shape
    assert r_b == r and b.is_contiguous() and out.stride(1) == 1, (h.shape, b.shape)
    assert out.shape[0] == t and out.shape[1] >= col0 + n and token_slots.shape == (t,)
    if t == 0:
        return out
    block_m, block_n = 16, 64
    grid = (triton.cdiv(t, block_m), triton.cdiv(n, block_n), num_slots)
    _expand_kernel[grid](
        h, b, out, token_slots, t, n, r, col0, h.stride(0), b.stride(0), b.stride(1),
        out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=_block_r(r),
        IEEE=out.dtype == torch.float32,
    )  # fmt: skip
    return out
