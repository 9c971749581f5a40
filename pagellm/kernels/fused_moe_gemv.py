"""The decode path of the quantized fused MoE (`fused_moe_quant.py`), Triton on CUDA.

At a few tokens a step each (token, expert) row is the only row of its expert, and the tiled
kernel pads it to a 16-row tensor-core tile and first groups the rows by expert (two more
launches). Here one program takes one row and BLOCK_N output columns: it reads the row's
expert's weights in wide K steps, dequantizes them on the CUDA cores and dots them with the
row's x in float32, as `wna16_gemm`'s GEMV does for a dense layer. No layout by expert: the
rows are the [T, K] routing as it comes.

    int4 / int8   `wna16_gemm`'s GEMV step: values placed in their words, a group's scale and
                  zero applied once (scale * (q . x - zero * sum x))
    mxfp4         int32 words of 8 codes: codes c and c + 4 of a word built as one float16
                  pair (`_e2m1_pair`) and dotted with x's columns 8 w + c and 8 w + c + 4;
                  a group's 4 words summed, then times its power of two
    fp8           not here: `fused_moe_quant`'s tiled kernel

Above GEMV_MAX_ROWS rows (T * top_k) experts repeat and reading an expert once per row costs
more than the padding. Rows of an out-of-range expert are skipped (their outputs left as
they were), as the tiled kernel skips them. The epilogue is the tiled kernel's
(`moe_epilogue.py`), so the rounding and gpt-oss's switches are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagellm.kernels.moe_epilogue import _store_epilogue, gpt_oss_switches
from pagellm.kernels.wna16_gemm import _gemv_row, _gemv_tile, _sub_blocks

GEMV_MAX_ROWS = 16  # T * top_k at most


@dataclass(frozen=True)
class GemvConfig:
    """A program's outputs (BLOCK_N), its K step (BLOCK_K columns: int, a power of two cut
    into sub-blocks inside groups; mxfp4, a power of two >= 32, the K tail masked)."""

    block_n: int
    block_k: int
    num_warps: int

    def __post_init__(self) -> None:
        if any(b < 1 or b & (b - 1) for b in (self.block_n, self.block_k, self.num_warps)):
            raise ValueError(f"GemvConfig: block_n, block_k and num_warps are powers of two: "
                             f"{self}")  # fmt: skip


def gemv_config(rows: int, k: int) -> GemvConfig:
    """Tiles for `rows` rows of K inputs: `benchmarks/moe.py --gemv-sweep`'s best on an H100
    at gpt-oss-20b's MXFP4 experts (2026-12-07): 8 outputs a program at one token (4 rows:
    more programs), 16 from two tokens on; K steps of 1,024."""
    block_n = 8 if rows <= 4 else 16
    return GemvConfig(block_n=block_n, block_k=min(1024, triton.next_power_of_2(k)), num_warps=4)


def gemv_serves(w) -> bool:
    """Whether this kernel reads the stack's format (a `QuantizedStack`)."""
    return w.mxfp4 or w.bits in (4, 8)


@triton.jit
def _e2m1_pair(words, c: tl.constexpr, PTX: tl.constexpr):
    """float32 of e2m1 codes c and c + 4 of int32 words of 8 codes (code i in bits 4i .. 4i +
    3), times 2^-14: a code's sign and magnitude bits (e, m) placed in a float16's sign,
    exponent and mantissa (2^(e - 15) (1 + m / 2), or m 2^-15 when e = 0: exact). Both float16s
    are built by one shift and mask of the word (c + 4 sits 16 bits above c), then widened."""
    if c <= 2:
        mag = words << (9 - 4 * c)
    else:
        mag = words >> (4 * c - 9)  # an arithmetic shift's fill lands above the masks
    sign = words << (12 - 4 * c)
    pair = (mag & 0x0E000E00) | (sign & -0x7FFF8000)  # bits 9-11 and 15 of each half
    if PTX:  # each half read in place (HADD2.F32 takes either half of a register)
        return tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
            "=r,=r,r", [pair], dtype=(tl.float32, tl.float32), is_pure=True, pack=1,
        )  # fmt: skip
    lo = pair.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _mxfp4_step(acc, x_row, q_ptr, s_ptr, offs_n, n_ok, k0, k_bytes, stride_qn, stride_sn,
                BLOCK_K: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """acc [BLOCK_N, BLOCK_K / 32] plus each group's dot of rows offs_n's columns k0 ..
    k0 + BLOCK_K (masked at K = 2 k_bytes) with x, times the group's scale (reduced over the
    groups once, after the K loop). The codes are read as int32 words of 8 (code c of a word
    in bits 4c .. 4c + 3, column 8 w + c), each code's value built from its word in place."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    w_ok = offs_w < k_bytes // 4
    words = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + offs_n[:, None] * (stride_qn // 4)
                    + offs_w[None, :], mask=n_ok[:, None] & w_ok[None, :], other=0)  # fmt: skip
    dots = tl.zeros((offs_n.shape[0], BLOCK_K // 8), tl.float32)
    for c in tl.static_range(4):  # codes c and c + 4: one float16 pair, built at once
        lo, hi = _e2m1_pair(words, c, PTX)
        x_lo = tl.load(x_row + 8 * offs_w + c, mask=w_ok, other=0.0).to(tl.float32)
        x_hi = tl.load(x_row + 8 * offs_w + c + 4, mask=w_ok, other=0.0).to(tl.float32)
        dots += lo * x_lo[None, :]
        dots += hi * x_hi[None, :]
    sums = tl.sum(tl.reshape(dots, (offs_n.shape[0], BLOCK_K // 32, 4)), axis=2)
    offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    g_ok = n_ok[:, None] & (offs_g < k_bytes // 16)[None, :]
    s = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :], mask=g_ok, other=0)
    scale = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 16384.0  # 2^(s - 127) * 2^14
    return acc + sums * scale


@triton.jit
def _moe_gemv_kernel(
    a_ptr, w_ptr, s_ptr, z_ptr, out_ptr, ids_ptr, weights_ptr, bias_ptr, num_experts, n_out,
    k_dim, k_bytes, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be,
    ROWS_PER_A: tl.constexpr, GATED: tl.constexpr, APPLY_WEIGHTS: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, MXFP4: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SUB: tl.constexpr, STEPS: tl.constexpr, PTX: tl.constexpr,
    HAS_BIAS: tl.constexpr = False, CLAMPED: tl.constexpr = False,
    SWIGLU_ALPHA: tl.constexpr = 1.702, SWIGLU_LIMIT: tl.constexpr = 7.0,
):  # fmt: skip
    """out[row, offs_n] for row = program 0 (a [T, K] routing's flat row), BLOCK_N columns
    = program 1; GATED: the up rows (n_out further) from the same x."""
    row = tl.program_id(0)
    expert = tl.load(ids_ptr + row).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out
    x_row = a_ptr + (row // ROWS_PER_A).to(tl.int64) * stride_am
    w_e = w_ptr + expert * stride_we
    s_e = s_ptr + expert * stride_se
    z_e = z_ptr + expert * stride_se
    if MXFP4:
        groups = tl.zeros((BLOCK_N, BLOCK_K // 32), tl.float32)
        groups_up = tl.zeros((BLOCK_N, BLOCK_K // 32), tl.float32)
        for k0 in range(0, k_dim, BLOCK_K):
            groups = _mxfp4_step(groups, x_row, w_e, s_e, offs_n, n_ok, k0, k_bytes, stride_wn,
                                 stride_sn, BLOCK_K, PTX)  # fmt: skip
            if GATED:
                groups_up = _mxfp4_step(groups_up, x_row, w_e, s_e, offs_n + n_out, n_ok, k0,
                                        k_bytes, stride_wn, stride_sn, BLOCK_K, PTX)  # fmt: skip
        acc = tl.sum(groups, axis=1)
        acc_up = tl.sum(groups_up, axis=1)
    else:
        per: tl.constexpr = 32 // BITS
        # x's column c scaled by 2^-(BITS * place), undoing the PLACED unpack (exact)
        x_place = tl.exp2(-(BITS * (tl.arange(0, BLOCK_K) % per % (per // 2))).to(tl.float32))
        acc = tl.zeros((BLOCK_N,), tl.float32)
        acc_up = tl.zeros((BLOCK_N,), tl.float32)
        kw = k_dim // per
        # `_gemv_tile`'s G, groups a row, is the scales' row stride: scales and zeros are
        # contiguous [E, N, G] (`fused_moe_quant._check_scales`)
        for k0 in range(0, k_dim, BLOCK_K):
            v, scale, zero = _gemv_tile(w_e, s_e, z_e, offs_n, n_ok, k0, kw, stride_sn,
                                        stride_wn, BITS, GROUP, SUB, STEPS, PTX)  # fmt: skip
            acc += _gemv_row(v, scale, zero, x_row, k0, k_dim, x_place, SUB, STEPS)
            if GATED:
                up = offs_n + n_out
                v, scale, zero = _gemv_tile(w_e, s_e, z_e, up, n_ok, k0, kw, stride_sn, stride_wn,
                                            BITS, GROUP, SUB, STEPS, PTX)  # fmt: skip
                acc_up += _gemv_row(v, scale, zero, x_row, k0, k_dim, x_place, SUB, STEPS)
    rows = tl.zeros((1,), tl.int64) + row
    _store_epilogue(acc[None, :], acc_up[None, :], out_ptr, weights_ptr, bias_ptr, expert,
                    stride_be, rows, rows >= 0, offs_n, n_ok, n_out, GATED, APPLY_WEIGHTS,
                    HAS_BIAS, CLAMPED, SWIGLU_ALPHA, SWIGLU_LIMIT)  # fmt: skip


def moe_gemv(
    a: torch.Tensor,  # [*, K]
    w,  # QuantizedStack [E, N_W, K] (mxfp4, int4, int8)
    out: torch.Tensor,  # [N, n_out]
    ids: torch.Tensor,  # [N] int32: each row's expert
    config: GemvConfig,
    rows_per_a: int,
    gated: bool = False,
    routing_weights: torch.Tensor | None = None,  # [N] float32
    bias: torch.Tensor | None = None,  # [E, N_W]
    clamped: tuple[float, float] | None = None,
) -> torch.Tensor:
    """out[r] = a[r // rows_per_a] @ dequant(w[ids[r]]).T for every row r (`moe_gemm_quant`'s
    contract, one program per row and BLOCK_N columns)."""
    e, n_w, k_dim = w.shape
    step = min(config.block_k, triton.next_power_of_2(k_dim))
    if w.mxfp4:
        step, (sub, steps) = max(step, 32), (0, 0)
    else:
        sub, steps = _sub_blocks(step, w.group, w.bits)
    q = w.q if w.mxfp4 else w.q.view(torch.int32)
    grid = (ids.numel(), triton.cdiv(out.shape[1], config.block_n))
    _moe_gemv_kernel[grid](
        a, q, w.scales, w.zeros if w.zeros is not None else w.scales, out, ids,
        routing_weights if routing_weights is not None else out,
        bias if bias is not None else out,  # a placeholder pointer when unused
        e, out.shape[1], k_dim, k_dim // 2, a.stride(0), q.stride(0), q.stride(1),
        w.scales.stride(0), w.scales.stride(1), bias.stride(0) if bias is not None else 0,
        ROWS_PER_A=rows_per_a, GATED=gated, APPLY_WEIGHTS=routing_weights is not None,
        BITS=w.bits, GROUP=w.group, MXFP4=w.mxfp4, BLOCK_N=config.block_n, BLOCK_K=step,
        SUB=sub, STEPS=steps, PTX=a.device.type == "cuda", num_warps=config.num_warps,
        **gpt_oss_switches(bias, clamped),
    )  # fmt: skip
    return out


def fused_moe_gemv(x, w13, w2, weights, ids, config: GemvConfig | None, bias13, bias2, clamped):
    """`fused_moe_quant.fused_moe_quant` for a few rows (its inputs checked there)."""
    (t, h), two_i, k = x.shape, w13.shape[1], ids.shape[1]
    flat_ids = ids.view(-1)
    act = torch.empty((t * k, two_i // 2), dtype=x.dtype, device=x.device)
    moe_gemv(x, w13, act, flat_ids, config or gemv_config(t * k, h), rows_per_a=k, gated=True,
             bias=bias13, clamped=clamped)  # fmt: skip
    y = torch.empty((t * k, h), dtype=x.dtype, device=x.device)
    moe_gemv(act, w2, y, flat_ids, config or gemv_config(t * k, two_i // 2), rows_per_a=1,
             routing_weights=weights.view(-1), bias=bias2)  # fmt: skip
    return y.view(t, k, h).sum(1)
