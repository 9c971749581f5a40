"""Fused mixture-of-experts on CUDA (Triton): routing, the tokens' layout by expert, and two
grouped GEMMs, one launch each.

    router logits [T, E] --topk_softmax--> weights [T, K] float32, ids [T, K] int32
    ids --align_by_expert--> sorted_ids [P]: the N = T * K rows (row r = token r // K, its k-th
            expert) grouped by expert, each expert's group padded to a multiple of BLOCK_M
            with the sentinel N; expert_ids [P / BLOCK_M]: each block's expert (E past the
            end); num_padded [1]: the used part of P
    x [T, H] --gate_up GEMM, SiLU-and-mul in the epilogue--> act [N, I]   (w13[e]: [2I, H])
    act --down GEMM, times the row's routing weight--> y [N, H]           (w2[e]: [H, I])
    y.view(T, K, H).sum(1) --> out [T, H]

gpt-oss's experts add a bias to each GEMM's accumulator (HAS_BIAS: w13's [E, 2I], w2's
[E, H]) and gate with the clamped SwiGLU in place of SiLU (CLAMPED): the shared epilogue
of `moe_epilogue.py`; other models compile neither.

Nothing is read back to the host: P is the worst case N + min(E, N) * (BLOCK_M - 1), the
grids are sized by it, and blocks past `num_padded` return at once, so a decode step runs
inside a CUDA graph. Rows of one expert land in the order atomics hand out slots; every row's
dot products are computed alone, so no output depends on that order.

Rounding follows the torch path (`pagellm.layers.moe.experts_torch`): gate and up rounded to
the activation dtype, SiLU's output rounded before the multiply, the down projection rounded
before the (float32) routing weight multiplies it. Every kernel tolerates garbage inputs
(out-of-range ids and block experts are skipped), as a dry forward under `compile_ahead` may
hand them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from pagellm.kernels.moe_epilogue import _store_epilogue, gpt_oss_switches


@dataclass(frozen=True)
class MoEConfig:
    """Tiles of both expert GEMMs; `block_m` is also the padding unit of each expert's rows."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int  # programs that walk down one column of M blocks before moving right (L2)
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        tiles = (self.block_m, self.block_n, self.block_k)
        if any(b < 16 or b & (b - 1) for b in tiles) or min(self.group_m, self.num_warps) < 1:
            raise ValueError(f"MoEConfig: tiles {tiles} must be powers of two >= 16 "
                             f"(tl.dot), group_m and num_warps >= 1: {self}")  # fmt: skip


# H200, bf16, by the average number of rows per expert (T * top_k / E). Shared memory per
# stage of the gated GEMM: 2 bytes * (BM * BK + 2 * BK * BN); compiled for sm_90 the rows
# below take 102-160 KiB of the 227 KiB. Re-tune with `python benchmarks/moe.py --sweep`.
H200_CONFIGS: tuple[tuple[float, MoEConfig], ...] = (
    (2, MoEConfig(16, 64, 128, 1, 4, 4)),  # decode, few tokens: stream each expert's weights
    (12, MoEConfig(16, 128, 64, 1, 4, 4)),
    (48, MoEConfig(32, 128, 64, 4, 4, 4)),
    (192, MoEConfig(64, 128, 64, 8, 4, 4)),
    (float("inf"), MoEConfig(128, 128, 64, 8, 8, 3)),  # prefill: compute-bound tiles
)
ALIGN_BLOCK = 256  # rows (and M blocks) per program of the align kernels


def choose_config(num_tokens: int, top_k: int, num_experts: int) -> MoEConfig:
    rows_per_expert = num_tokens * top_k / num_experts
    return next(cfg for bound, cfg in H200_CONFIGS if rows_per_expert <= bound)


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,  # [T, E] (rows at stride_t, experts contiguous)
    weights_ptr,  # [T, TOP_K] float32
    ids_ptr,  # [T, TOP_K] int32
    num_experts,
    stride_t,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    valid = offs < num_experts
    x = tl.load(logits_ptr + t * stride_t + offs, mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(valid, p / tl.sum(p, 0), -1.0)  # softmax over every expert, as HF routes
    slots = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], tl.float32)
    top_i = tl.zeros([K_PAD], tl.int32)
    for k in tl.static_range(TOP_K):
        best, idx = tl.max(p, 0, return_indices=True)  # the lowest index among equals
        top_w = tl.where(slots == k, best, top_w)
        top_i = tl.where(slots == k, idx, top_i)
        p = tl.where(offs == idx, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 0)  # padded slots hold 0
    tl.store(weights_ptr + t * TOP_K + slots, top_w, mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, top_i, mask=slots < TOP_K)


@triton.jit
def _count_kernel(
    ids_ptr,  # [N] int32: the expert of each row
    counts_ptr,  # [E] int32, zeroed: rows per expert (atomic)
    sorted_ids_ptr,  # [P] int32: set to the sentinel N here, rows scattered next
    num_rows,  # N
    num_slots,  # P
    num_experts,
    BLOCK: tl.constexpr,
    E_PAD: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    sentinel = tl.zeros([BLOCK], tl.int32) + num_rows
    tl.store(sorted_ids_ptr + offs, sentinel, mask=offs < num_slots)
    e = tl.load(ids_ptr + offs, mask=offs < num_rows, other=-1)
    ok = (e >= 0) & (e < num_experts)
    hist = tl.histogram(tl.where(ok, e, 0), E_PAD, mask=ok)  # [E_PAD]
    experts = tl.arange(0, E_PAD)
    tl.atomic_add(counts_ptr + experts, hist, mask=(experts < num_experts) & (hist > 0))


@triton.jit
def _scatter_kernel(
    ids_ptr,  # [N] int32
    counts_ptr,  # [E] int32: rows per expert, complete
    cursor_ptr,  # [E] int32, zeroed: rows placed so far per expert (atomic)
    sorted_ids_ptr,  # [P] int32
    expert_ids_ptr,  # [P / BLOCK_M] int32
    num_padded_ptr,  # [1] int32
    num_rows,
    num_blocks,  # P / BLOCK_M
    num_experts,
    BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
):
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)  # [E_PAD]: where each expert's padded group ends
    # this program's rows go to their expert's group
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + offs, mask=offs < num_rows, other=-1)
    ok = (e >= 0) & (e < num_experts)
    e = tl.where(ok, e, 0)
    slot = tl.atomic_add(cursor_ptr + e, 1, mask=ok)
    dest = tl.gather(ends - padded, e, 0) + slot
    tl.store(sorted_ids_ptr + dest, offs, mask=ok & (slot < tl.gather(counts, e, 0)))
    # this program's M blocks: the expert whose group holds the block's first row
    blocks = pid * BLOCK + tl.arange(0, BLOCK)
    first_row = blocks * BLOCK_M
    owner = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), 1)  # E_PAD past the end
    tl.store(expert_ids_ptr + blocks, owner, mask=blocks < num_blocks)
    if pid == 0:
        tl.store(num_padded_ptr, tl.sum(padded, 0))


@triton.jit
def _tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(M block, N block) of a program: GROUP_M M blocks share each N block's weights in L2."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _expert_dot(a_ptrs, w_ptrs, row_ok, n_ok, offs_k, n_out, k_dim, stride_wn, GATED: tl.constexpr,
                EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):  # fmt: skip
    """The rows' a [BLOCK_M, K] times the expert's weight columns [K, BLOCK_N], walking K
    from `a_ptrs` / `w_ptrs` (the first BLOCK_K step), float32 accumulators; GATED: the up
    rows' product too (n_out rows further into w), from the same a tile."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        a_mask = row_ok[:, None]
        w_mask = n_ok[None, :]
        if not EVEN_K:
            a_mask = a_mask & (offs_k[None, :] < k_dim - k0)
            w_mask = w_mask & (offs_k[:, None] < k_dim - k0)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, input_precision="ieee")
        if GATED:
            w_up = tl.load(w_ptrs + n_out * stride_wn, mask=w_mask, other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision="ieee")
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc, acc_up


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [*, K] rows contiguous: x [T, H] (gate_up) or act [N, I] (down)
    w_ptr,  # [E, N_W, K] K contiguous: w13 [E, 2I, H] or w2 [E, H, I]
    out_ptr,  # [N, n_out] contiguous: act [N, I] or y [N, H]
    sorted_ids_ptr,  # [P] int32
    expert_ids_ptr,  # [P / BLOCK_M] int32
    num_padded_ptr,  # [1] int32
    weights_ptr,  # [N] float32 routing weights (APPLY_WEIGHTS)
    bias_ptr,  # [E, N_W] the expert's bias (HAS_BIAS)
    num_rows,  # N: the padding sentinel
    num_experts,
    n_out,  # output columns; GATED: up's rows start at n_out in each expert's w
    k_dim,
    stride_am,
    stride_we,
    stride_wn,
    num_blocks,  # M blocks in the grid: P / BLOCK_M
    stride_be,  # the bias's, between experts
    ROWS_PER_A: tl.constexpr,  # row r reads a[r // ROWS_PER_A]: top_k for gate_up, 1 for down
    GATED: tl.constexpr,
    APPLY_WEIGHTS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,
    CLAMPED: tl.constexpr = False,  # GATED by gpt-oss's clamped SwiGLU, not SiLU
    SWIGLU_ALPHA: tl.constexpr = 1.702,
    SWIGLU_LIMIT: tl.constexpr = 7.0,
):
    pid_m, pid_n = _tile(tl.program_id(0), num_blocks, tl.cdiv(n_out, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):
        return
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = (rows >= 0) & (rows < num_rows)
    rows = tl.where(row_ok, rows, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows // ROWS_PER_A)[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    acc, acc_up = _expert_dot(a_ptrs, w_ptrs, row_ok, n_ok, offs_k, n_out, k_dim, stride_wn,
                              GATED, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    _store_epilogue(acc, acc_up, out_ptr, weights_ptr, bias_ptr, expert, stride_be, rows, row_ok,
                    offs_n, n_ok, n_out, GATED, APPLY_WEIGHTS, HAS_BIAS, CLAMPED, SWIGLU_ALPHA,
                    SWIGLU_LIMIT)  # fmt: skip


def topk_softmax(
    logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,  # divide the top-k probabilities by their sum
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, top_k] float32, ids [T, top_k] int32
    """Softmax over all experts, then the top k: one program per token."""
    t, e = logits.shape
    if logits.stride(-1) != 1 or not 0 < top_k <= e:
        raise ValueError(f"topk_softmax: logits {tuple(logits.shape)}, top_k {top_k}")
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    _topk_softmax_kernel[(t,)](
        logits, weights, ids, e, logits.stride(0),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(e),
        RENORMALIZE=renormalize, num_warps=1 if e <= 256 else 4,
    )  # fmt: skip
    return weights, ids


@dataclass(frozen=True)
class ExpertLayout:
    """The rows of a step grouped by expert (see the module doc); sizes depend only on T."""

    sorted_ids: torch.Tensor  # [P] int32: row indices, the sentinel N as padding
    expert_ids: torch.Tensor  # [P / block_m] int32: each block's expert (>= E: unused)
    num_padded: torch.Tensor  # [1] int32: used slots of sorted_ids, a multiple of block_m


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """P: every expert's group rounded up to block_m, at most min(E, N) groups non-empty."""
    bound = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertLayout:
    """Group the rows of `ids` [T, K] by expert, padded per expert to block_m: two launches."""
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        raise ValueError(f"align_by_expert: ids must be contiguous int32, got {ids.dtype}")
    n, dev = ids.numel(), ids.device
    slots = max_padded_rows(n, num_experts, block_m)
    num_blocks = slots // block_m
    sorted_ids = torch.empty(slots, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    counters = torch.zeros(2, num_experts, dtype=torch.int32, device=dev)  # counts, cursors
    e_pad = triton.next_power_of_2(num_experts)
    _count_kernel[(triton.cdiv(slots, ALIGN_BLOCK),)](
        ids, counters[0], sorted_ids, n, slots, num_experts, BLOCK=ALIGN_BLOCK, E_PAD=e_pad
    )
    grid = (triton.cdiv(max(n, num_blocks), ALIGN_BLOCK),)
    _scatter_kernel[grid](
        ids, counters[0], counters[1], sorted_ids, expert_ids, num_padded,
        n, num_blocks, num_experts, BLOCK=ALIGN_BLOCK, BLOCK_M=block_m, E_PAD=e_pad,
    )  # fmt: skip
    return ExpertLayout(sorted_ids, expert_ids, num_padded)


def moe_gemm(
    a: torch.Tensor,  # [*, K]
    w: torch.Tensor,  # [E, N_W, K]
    out: torch.Tensor,  # [N, n_out]
    layout: ExpertLayout,
    config: MoEConfig,
    rows_per_a: int,
    gated: bool = False,  # w holds gate | up rows; out gets SiLU(gate) * up
    routing_weights: torch.Tensor | None = None,  # [N] float32: scale each output row
    bias: torch.Tensor | None = None,  # [E, N_W]: added to each row's product
    clamped: tuple[float, float] | None = None,  # gated: (alpha, limit) of the clamped SwiGLU
) -> torch.Tensor:
    """out[r] = a[r // rows_per_a] @ w[expert of r].T for every row r of the layout."""
    if w.shape[1] != out.shape[1] * (2 if gated else 1):
        raise ValueError(f"moe_gemm: w {tuple(w.shape)} does not fit out {tuple(out.shape)}")
    k_dim, c = a.shape[1], config
    num_blocks = layout.expert_ids.numel()
    grid = (num_blocks * triton.cdiv(out.shape[1], c.block_n),)
    _moe_gemm_kernel[grid](
        a, w, out, layout.sorted_ids, layout.expert_ids, layout.num_padded,
        routing_weights if routing_weights is not None else out,
        bias if bias is not None else out,  # a placeholder pointer when unused
        out.shape[0], w.shape[0], out.shape[1], k_dim,
        a.stride(0), w.stride(0), w.stride(1), num_blocks,
        bias.stride(0) if bias is not None else 0,
        ROWS_PER_A=rows_per_a, GATED=gated, APPLY_WEIGHTS=routing_weights is not None,
        EVEN_K=k_dim % c.block_k == 0,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
        num_warps=c.num_warps, num_stages=c.num_stages, **gpt_oss_switches(bias, clamped),
    )  # fmt: skip
    return out


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, K] float32 routing weights
    ids: torch.Tensor,  # [T, K] int32 experts
    config: MoEConfig | None = None,
    bias13: torch.Tensor | None = None,  # [E, 2I] (gpt-oss)
    bias2: torch.Tensor | None = None,  # [E, H]
    activation: Any = None,  # a `ClampedSwiGLU` (alpha, limit); None: SiLU
) -> torch.Tensor:  # [T, H]
    """sum over k of weights[t, k] * down(SiLU(gate(x[t])) * up(x[t])) with expert ids[t, k]
    (gpt-oss: biased GEMMs, the clamped SwiGLU)."""
    _check_moe_inputs(x, w13, w2, weights, ids)
    for bias, w in ((bias13, w13), (bias2, w2)):
        if bias is not None and (bias.shape != w.shape[:2] or not bias.is_contiguous()):
            raise ValueError(f"fused_moe: bias {tuple(bias.shape)} for weights {tuple(w.shape)}")
    clamped = None if activation is None else (activation.alpha, activation.limit)
    (t, h), (e, two_i, _), k = x.shape, w13.shape, ids.shape[1]
    config = config or choose_config(t, k, e)
    layout = align_by_expert(ids, e, config.block_m)
    act = torch.empty((t * k, two_i // 2), dtype=x.dtype, device=x.device)
    moe_gemm(x, w13, act, layout, config, rows_per_a=k, gated=True, bias=bias13, clamped=clamped)
    y = torch.empty((t * k, h), dtype=x.dtype, device=x.device)
    moe_gemm(act, w2, y, layout, config, rows_per_a=1, routing_weights=weights.view(-1),
             bias=bias2)  # fmt: skip
    return y.view(t, k, h).sum(1)


def _check_moe_inputs(x, w13, w2, weights, ids) -> None:
    t, h = x.shape
    e, two_i, h13 = w13.shape
    if h13 != h or w2.shape != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
        )
    if ids.shape != weights.shape or ids.shape[0] != t or weights.dtype != torch.float32:
        raise ValueError(f"fused_moe: ids {tuple(ids.shape)}, weights {tuple(weights.shape)}")
    if not (x.stride(1) == 1 and weights.is_contiguous()):
        raise ValueError("fused_moe: x rows and the routing weights must be contiguous")
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("fused_moe: expert weights must be contiguous")
    if not (x.dtype == w13.dtype == w2.dtype):
        raise TypeError(f"fused_moe: dtypes {x.dtype}, {w13.dtype}, {w2.dtype} differ")
