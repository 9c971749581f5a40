"""Fused mixture-of-experts with quantized expert weights (Triton, CUDA): `fused_moe.py`'s
routing, layout by expert, tiles and epilogue, with each weight tile read in its stored form
and dequantized in registers into x's dtype before the tensor-core dot (weights never
written back to memory in bf16).

    int (W4A16 / W8A16)  q [E, N, K * bits / 8] uint8 (`wna16_formats.py`'s canonical rows:
                         4-bit, byte j holds column 2j low, 2j + 1 high; read as int32
                         words, unpacked as `wna16_gemm._unpack` does), scales float32
                         [E, N, G], zeros uint8 [E, N, G]: w = (q - zero) * scale, groups of
                         GROUP inputs (BLOCK_K divides it: a K step reads one scale a row)
    fp8                  q [E, N, K] float8_e4m3fn, read as int16 pairs (`fp8_convert`), scales
                         float32 [E, N] (a row's) or [E, ceil(N / 128), ceil(K / 128)] (128 x
                         128 blocks: BLOCK_K divides 128)
    mxfp4 (gpt-oss)      q [E, N, K / 2] uint8 (two e2m1 codes a byte, column 2j low), scales
                         uint8 [E, N, K / 32] (E8M0: 2 ** (s - 127)); BLOCK_K a multiple of 32
                         (a K step reads whole groups); values and powers of two built
                         exactly (a scale byte 0, 2 ** -127, reads as 0; bytes above 240
                         overflow the float32 that holds 2 ** (s - 127) * 2 ** 14: the
                         loader refuses them, `mxfp4.MAX_KERNEL_SCALE`)

gpt-oss's expert biases and clamped SwiGLU are `fused_moe.py`'s switches, in the same
epilogue (`_store_epilogue`).

The dequantized tile is rounded to x's dtype as a weight dequantized at load would be, so the
result is `experts_torch` on those weights up to the order of summation. K must be a multiple
of BLOCK_K (every MoE model's hidden and expert sizes are multiples of 64).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagellm.kernels.fp8_convert import fp8_pairs_to_f16, load_fp8_pairs
from pagellm.kernels.fused_moe import (
    ExpertLayout,
    MoEConfig,
    _tile,
    align_by_expert,
    choose_config,
)
from pagellm.kernels.fused_moe_gemv import (
    GEMV_MAX_ROWS,
    GemvConfig,
    _e2m1_pair,
    fused_moe_gemv,
    gemv_serves,
)
from pagellm.kernels.moe_epilogue import _store_epilogue, gpt_oss_switches
from pagellm.kernels.wna16_gemm import MAGIC, PAIRS_MIN_K, _int4_pairs, _unpack

FP8_BLOCK = 128  # the fp8 block scales' rows and columns

# MXFP4 experts (gpt-oss), by rows per expert (T * top_k / E), as `fused_moe.H200_CONFIGS`:
# `benchmarks/moe.py --model gpt-oss-20b --weights mxfp4 --sweep` on an H100 (2026-12-07).
# Dequantizing a tile costs more than its MMAs, so taller M tiles than bf16's pay above 8 rows
# an expert (256 tokens: 0.40 ms a layer against 0.62 ms with bf16's tiles). K steps of 64:
# the sweep's 128 halved for K = 2,880 (45 x 64), as `_block_k` would. Up to 16 rows a step
# (T * top_k) the GEMV runs instead (`fused_moe_gemv.py`).
MXFP4_CONFIGS: tuple[tuple[float, MoEConfig], ...] = (
    (8, MoEConfig(16, 64, 64, 1, 4, 3)),
    (float("inf"), MoEConfig(64, 64, 64, 1, 4, 3)),
)


@dataclass(frozen=True)
class QuantizedStack:
    """One stacked expert weight [E, N, K] as the kernel reads it (see the module doc)."""

    q: torch.Tensor  # int: uint8 [E, N, K * bits / 8]; fp8: float8_e4m3fn [E, N, K]
    scales: torch.Tensor  # float32: int [E, N, G]; fp8 [E, N] or [E, N / 128, K / 128]
    zeros: torch.Tensor | None  # int: uint8 [E, N, G]; fp8: None
    bits: int  # 4 | 8: int weights (mxfp4: 4); 0: fp8
    group: int  # int: inputs a scale (K for one group); fp8: 128 (blocks) or 0 (rows)
    mxfp4: bool = False  # e2m1 codes with E8M0 scales (uint8), groups of 32

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, width = self.q.shape
        return e, n, width * 8 // self.bits if self.bits else width


@triton.jit
def _weight_tile(w_ptr, s_ptr, z_ptr, expert, offs_n, n_ok, k0, offs_k, stride_we, stride_wn,
                 stride_se, stride_sn, dtype, BITS: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK_K: tl.constexpr, PTX_CVT: tl.constexpr,
                 MXFP4: tl.constexpr = False):  # fmt: skip
    """[BLOCK_K, BLOCK_N]: columns k0 + offs_k of the expert's rows offs_n, in `dtype`."""
    if MXFP4:
        w = _mxfp4_tile(w_ptr + expert * stride_we, s_ptr + expert * stride_se, offs_n, n_ok,
                        k0, stride_wn, stride_sn, dtype, BLOCK_K, PTX_CVT)  # fmt: skip
    elif BITS == 0:
        w = _fp8_tile(w_ptr + expert * stride_we, s_ptr + expert * stride_se, offs_n, n_ok, k0,
                      stride_wn, stride_sn, dtype, GROUP, BLOCK_K, PTX_CVT)  # fmt: skip
    else:
        w = _int_tile(w_ptr + expert * stride_we, s_ptr + expert * stride_se,
                      z_ptr + expert * stride_se, offs_n, n_ok, k0, offs_k, stride_wn,
                      stride_sn, dtype, BITS, GROUP, PTX_CVT)  # fmt: skip
    return w


@triton.jit
def _fp8_tile(w_ptr, s_ptr, offs_n, n_ok, k0, stride_wn, stride_sn, dtype, GROUP: tl.constexpr,
              BLOCK_K: tl.constexpr, PTX_CVT: tl.constexpr):  # fmt: skip
    """fp8 rows read as int16 pairs, times their row's or block's scale, transposed."""
    pairs = load_fp8_pairs(w_ptr, offs_n * stride_wn + k0, n_ok, BLOCK_K)
    w = fp8_pairs_to_f16(pairs, 1, PTX_CVT).to(tl.float32)  # [BLOCK_N, BLOCK_K]
    if GROUP:
        scale = tl.load(s_ptr + (offs_n // GROUP) * stride_sn + k0 // GROUP, mask=n_ok, other=0.0)
    else:
        scale = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
    return tl.trans((w * scale[:, None]).to(dtype))


@triton.jit
def _mxfp4_tile(q_ptr, s_ptr, offs_n, n_ok, k0, stride_qn, stride_sn, dtype,
                BLOCK_K: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """Rows offs_n, columns k0 .. k0 + BLOCK_K (BLOCK_K a multiple of 32): e2m1 codes times
    their group's power of two, exact in float32, as [BLOCK_K, BLOCK_N] in `dtype`. The codes
    are read as int32 words of 8 (`fused_moe_gemv._e2m1_pair` builds codes c and c + 4 of a
    word at once); the 8 values of a word are joined into its 8 columns in order (register
    moves), and the values' 2^-14 is folded into the scale."""
    words_per_row: tl.constexpr = BLOCK_K // 8
    offs_w = k0 // 8 + tl.arange(0, words_per_row)
    words = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + offs_n[:, None] * (stride_qn // 4)
                    + offs_w[None, :], mask=n_ok[:, None], other=0)  # fmt: skip
    v0, v4 = _e2m1_pair(words, 0, PTX)
    v1, v5 = _e2m1_pair(words, 1, PTX)
    v2, v6 = _e2m1_pair(words, 2, PTX)
    v3, v7 = _e2m1_pair(words, 3, PTX)
    # [BLOCK_N, words, 2, 2, 2]: the first join's index is code c's bit 2, the last's bit 0
    value = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)),
                    tl.join(tl.join(v1, v5), tl.join(v3, v7)))  # fmt: skip
    offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    s = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :], mask=n_ok[:, None],
                other=127).to(tl.int32)  # fmt: skip
    scale = (s << 23).to(tl.float32, bitcast=True) * 16384.0  # 2^(s - 127) * 2^14
    value = tl.reshape(value, (offs_n.shape[0], BLOCK_K // 32, 32)) * scale[:, :, None]
    return tl.trans(tl.reshape(value, (offs_n.shape[0], BLOCK_K)).to(dtype))


@triton.jit
def _int_tile(q_ptr, s_ptr, z_ptr, offs_n, n_ok, k0, offs_k, stride_qn, stride_sn, dtype,
              BITS: tl.constexpr, GROUP: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """int rows' columns k0 + offs_k (in group k0 // GROUP), (q - zero) * scale, read as int32
    words and unpacked as `wna16_gemm` unpacks them (no integer-to-float conversion): 4-bit
    values for bf16 / fp16 x as 16-bit pairs (`_int4_pairs`, K steps from PAIRS_MIN_K: see
    `wna16_gemm.pairs_serve`), else in float32."""
    words = k0 // (32 // BITS) + tl.arange(0, offs_k.shape[0] // (32 // BITS))
    qw = tl.load(q_ptr + offs_n[:, None] * stride_qn + words[None, :], mask=n_ok[:, None], other=0)
    s_off = offs_n * stride_sn + k0 // GROUP
    scale = tl.load(s_ptr + s_off, mask=n_ok, other=0.0)
    zero = tl.load(z_ptr + s_off, mask=n_ok, other=0)
    sixteen_bit: tl.constexpr = dtype == tl.bfloat16 or dtype == tl.float16
    if BITS == 4 and sixteen_bit and offs_k.shape[0] >= PAIRS_MIN_K:
        return tl.trans(_int4_pairs(qw, zero.to(tl.int32), scale, dtype, PTX))
    w = (_unpack(qw, offs_k, BITS, False) - (MAGIC + zero.to(tl.float32)[:, None])) * scale[:, None]
    return tl.trans(w.to(dtype))  # [BLOCK_K, BLOCK_N]


@triton.jit
def _moe_quant_gemm_kernel(
    a_ptr, w_ptr, s_ptr, z_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    weights_ptr, bias_ptr, num_rows, num_experts, n_out, k_dim, stride_am, stride_we, stride_wn,
    stride_se, stride_sn, num_blocks, stride_be,
    ROWS_PER_A: tl.constexpr, GATED: tl.constexpr, APPLY_WEIGHTS: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, PTX_CVT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    MXFP4: tl.constexpr = False, HAS_BIAS: tl.constexpr = False, CLAMPED: tl.constexpr = False,
    SWIGLU_ALPHA: tl.constexpr = 1.702, SWIGLU_LIMIT: tl.constexpr = 7.0,
):  # fmt: skip
    """`_moe_gemm_kernel` (fused_moe.py) with quantized weights: the same programs, rows and
    epilogue; the scales' row r of an expert belongs to its weight row r (GATED: the up rows
    at n_out further, scales too)."""
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
    a_ptrs = a_ptr + (rows // ROWS_PER_A)[:, None] * stride_am + offs_k[None, :]
    dtype = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        a = tl.load(a_ptrs + k0, mask=row_ok[:, None], other=0.0)
        w = _weight_tile(
            w_ptr,
            s_ptr,
            z_ptr,
            expert,
            offs_n,
            n_ok,
            k0,
            offs_k,
            stride_we,
            stride_wn,
            stride_se,
            stride_sn,
            dtype,
            BITS,
            GROUP,
            BLOCK_K,
            PTX_CVT,
            MXFP4,
        )
        acc = tl.dot(a, w, acc, input_precision="ieee")
        if GATED:
            w_up = _weight_tile(w_ptr, s_ptr, z_ptr, expert, offs_n + n_out, n_ok, k0, offs_k,
                                stride_we, stride_wn, stride_se, stride_sn, dtype, BITS, GROUP,
                                BLOCK_K, PTX_CVT, MXFP4)  # fmt: skip
            acc_up = tl.dot(a, w_up, acc_up, input_precision="ieee")
    _store_epilogue(acc, acc_up, out_ptr, weights_ptr, bias_ptr, expert, stride_be, rows, row_ok,
                    offs_n, n_ok, n_out, GATED, APPLY_WEIGHTS, HAS_BIAS, CLAMPED, SWIGLU_ALPHA,
                    SWIGLU_LIMIT)  # fmt: skip


def _block_k(step: int, w: QuantizedStack, k: int) -> int:
    """The K step `step`, halved until it divides K and the weight's scale groups (mxfp4:
    until it is whole groups of 32 that divide K)."""

    def fits(step: int) -> bool:
        groups = step % w.group == 0 if w.mxfp4 else (w.group or k) % step == 0
        return k % step == 0 and groups

    while step > 16 and not fits(step):
        step //= 2
    if not fits(step):
        raise ValueError(f"fused_moe_quant: K={k} and scale groups of {w.group} need a multiple "
                         "of 16 (mxfp4: of 32)")  # fmt: skip
    return step


def moe_gemm_quant(
    a: torch.Tensor,  # [*, K]
    w: QuantizedStack,  # [E, N_W, K]
    out: torch.Tensor,  # [N, n_out]
    layout: ExpertLayout,
    config: MoEConfig,
    rows_per_a: int,
    gated: bool = False,  # w holds gate | up rows; out gets SiLU(gate) * up
    routing_weights: torch.Tensor | None = None,  # [N] float32: scale each output row
    bias: torch.Tensor | None = None,  # [E, N_W] (gpt-oss)
    clamped: tuple[float, float] | None = None,  # gated: the clamped SwiGLU's (alpha, limit)
) -> torch.Tensor:
    """out[r] = a[r // rows_per_a] @ dequant(w[expert of r]).T for every row r of the layout."""
    e, n_w, k_dim = w.shape
    if n_w != out.shape[1] * (2 if gated else 1) or k_dim != a.shape[1]:
        raise ValueError(f"moe_gemm_quant: w {w.shape} does not fit a {tuple(a.shape)}, "
                         f"out {tuple(out.shape)}")  # fmt: skip
    c = dataclasses.replace(config, block_k=_block_k(config.block_k, w, k_dim))
    num_blocks = layout.expert_ids.numel()
    scales = w.scales
    # int: [E, N_W, K * bits / 32] words; mxfp4 and fp8: as stored
    q = w.q.view(torch.int32) if w.bits and not w.mxfp4 else w.q
    grid = (num_blocks * triton.cdiv(out.shape[1], c.block_n),)
    _moe_quant_gemm_kernel[grid](
        a, q, scales, w.zeros if w.zeros is not None else scales, out, layout.sorted_ids,
        layout.expert_ids, layout.num_padded,
        routing_weights if routing_weights is not None else out,
        bias if bias is not None else out,  # a placeholder pointer when unused
        out.shape[0], e, out.shape[1], k_dim, a.stride(0), q.stride(0), q.stride(1),
        scales.stride(0), scales.stride(1) if scales.dim() > 2 else 0, num_blocks,
        bias.stride(0) if bias is not None else 0,
        ROWS_PER_A=rows_per_a, GATED=gated, APPLY_WEIGHTS=routing_weights is not None,
        BITS=w.bits, GROUP=w.group, PTX_CVT=a.device.type == "cuda",
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
        num_warps=c.num_warps, num_stages=c.num_stages,
        **({"MXFP4": True} if w.mxfp4 else {}), **gpt_oss_switches(bias, clamped),
    )  # fmt: skip
    return out


def fused_moe_quant(
    x: torch.Tensor,  # [T, H] bf16 / fp16 (float32 in the interpreter)
    w13: QuantizedStack,  # [E, 2I, H]: gate rows, then up rows
    w2: QuantizedStack,  # [E, H, I]
    weights: torch.Tensor,  # [T, K] float32 routing weights
    ids: torch.Tensor,  # [T, K] int32 experts
    config: MoEConfig | GemvConfig | None = None,  # None: the GEMV at a few rows, else tiles
    bias13: torch.Tensor | None = None,  # [E, 2I] (gpt-oss)
    bias2: torch.Tensor | None = None,  # [E, H]
    activation=None,  # a `ClampedSwiGLU`; None: SiLU
) -> torch.Tensor:  # [T, H]
    """`fused_moe.fused_moe` with quantized expert weights (see the module doc); up to
    GEMV_MAX_ROWS rows (T * top_k) of formats it reads, `fused_moe_gemv.py`'s decode path."""
    _check(x, w13, w2, weights, ids, bias13, bias2)
    clamped = None if activation is None else (activation.alpha, activation.limit)
    (t, h), (e, two_i, _), k = x.shape, w13.shape, ids.shape[1]
    asked = isinstance(config, GemvConfig)
    if gemv_serves(w13) and gemv_serves(w2):
        if asked or (config is None and t * k <= GEMV_MAX_ROWS):
            return fused_moe_gemv(x, w13, w2, weights, ids, config, bias13, bias2, clamped)
    elif asked:
        raise ValueError("fused_moe_quant: the GEMV reads int and mxfp4 experts, not fp8")
    config = config or default_config(t, k, e, w13)
    layout = align_by_expert(ids, e, config.block_m)
    act = torch.empty((t * k, two_i // 2), dtype=x.dtype, device=x.device)
    moe_gemm_quant(x, w13, act, layout, config, rows_per_a=k, gated=True, bias=bias13,
                   clamped=clamped)  # fmt: skip
    y = torch.empty((t * k, h), dtype=x.dtype, device=x.device)
    moe_gemm_quant(act, w2, y, layout, config, rows_per_a=1, routing_weights=weights.view(-1),
                   bias=bias2)  # fmt: skip
    return y.view(t, k, h).sum(1)


def default_config(num_tokens: int, top_k: int, num_experts: int, w: QuantizedStack) -> MoEConfig:
    """The tiles `fused_moe_quant` picks for this many rows: MXFP4_CONFIGS for MXFP4 experts,
    `fused_moe.choose_config`'s (bf16's) otherwise."""
    if w.mxfp4:
        rows_per_expert = num_tokens * top_k / num_experts
        return next(c for bound, c in MXFP4_CONFIGS if rows_per_expert <= bound)
    return choose_config(num_tokens, top_k, num_experts)


def _check(x, w13: QuantizedStack, w2: QuantizedStack, weights, ids, bias13, bias2) -> None:
    for w in (w13, w2):
        if w.mxfp4:
            _check_mxfp4(w)
            continue
        fp8 = w.q.dtype == torch.float8_e4m3fn
        if not (w.q.is_contiguous() and w.scales.is_contiguous()) or fp8 != (w.bits == 0):
            raise ValueError(f"fused_moe_quant: a {w.bits}-bit stack of {w.q.dtype} "
                             "(contiguous, fp8 with bits 0)")  # fmt: skip
        if w.scales.dtype != torch.float32 or (w.zeros is None) != fp8:
            raise ValueError("fused_moe_quant: float32 scales; int weights with zeros")
        _block_k(128, w, w.shape[2])  # the tiles' K step exists (whichever kernel runs)
        _check_scales(w)
    for bias, w in ((bias13, w13), (bias2, w2)):
        if bias is not None and (tuple(bias.shape) != w.shape[:2] or not bias.is_contiguous()):
            raise ValueError(f"fused_moe_quant: bias {tuple(bias.shape)} for weights {w.shape}")
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        raise ValueError(f"fused_moe_quant: ids must be contiguous int32, got {ids.dtype}")
    (t, h), (e, two_i, h13) = x.shape, w13.shape
    if h13 != h or w2.shape != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(f"fused_moe_quant: x {tuple(x.shape)}, w13 {w13.shape}, w2 {w2.shape}")
    if ids.shape != weights.shape or ids.shape[0] != t or weights.dtype != torch.float32:
        raise ValueError(f"fused_moe_quant: ids {tuple(ids.shape)}, weights {tuple(weights.shape)}")
    if x.stride(1) != 1 or not weights.is_contiguous():
        raise ValueError("fused_moe_quant: x rows and the routing weights must be contiguous")


def _check_scales(w: QuantizedStack) -> None:
    """int: scales and zeros [E, N, ceil(K / group)]; fp8: [E, N] (rows) or [E, ceil(N / 128),
    ceil(K / 128)] (blocks)."""
    e, n, k = w.shape
    if w.bits:
        want = (e, n, -(-k // w.group))
        if w.zeros.shape != want or not w.zeros.is_contiguous():
            raise ValueError(f"fused_moe_quant: zeros {tuple(w.zeros.shape)} for {w.shape} in "
                             f"groups of {w.group}: expected contiguous {want}")  # fmt: skip
    else:
        want = (e, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)) if w.group else (e, n)
    if w.scales.shape != want:
        raise ValueError(f"fused_moe_quant: scales {tuple(w.scales.shape)} for {w.shape}: "
                         f"expected {want}")  # fmt: skip


def _check_mxfp4(w: QuantizedStack) -> None:
    e, n, k = w.shape
    uint8 = w.q.dtype == w.scales.dtype == torch.uint8
    if not (uint8 and w.q.is_contiguous() and w.scales.is_contiguous() and w.bits == 4):
        raise ValueError("fused_moe_quant: mxfp4 stacks are contiguous uint8 codes and scales")
    if k % 32 or w.scales.shape != (e, n, k // 32) or w.zeros is not None:
        raise ValueError(f"fused_moe_quant: mxfp4 scales {tuple(w.scales.shape)} for {w.shape}")
