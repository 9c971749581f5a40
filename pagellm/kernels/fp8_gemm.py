"""Triton fp8 (e4m3) GEMMs for `quantization="fp8"`: y = x @ dequant(w)^T (+ bias).

Weights are float8_e4m3fn [N, K] (row-major, K contiguous) with float32 scales, either one per
output row (`w_scale` [N]; per-tensor checkpoints are expanded to it) or one per 128x128 block
(`w_scale` [ceil(N / 128), ceil(K / 128)], DeepSeek-V3 / Qwen3-FP8's `weight_scale_inv`).

    fp8_gemm(x bf16, w, w_scale)          weight-only: w tiles are upcast in registers
                                          (decode sizes: the GEMM streams the weight; no
                                          activation rounding, no extra kernel)
    fp8_gemm(xq fp8, w, w_scale, x_scale) w8a8: x quantized per token (per-channel w) or per
                                          (token, 128 columns) (block w) by `quantize_fp8`

One tl.dot kernel serves both (`A_FP8`), with the block scales applied per 128-wide K step.
Each program computes a BLOCK_M x BLOCK_N tile of y, walking K; at decode sizes (BLOCK_N
small, one M tile) the grid is N / BLOCK_N programs, each streaming BLOCK_N weight rows.
Weight-only, w is read as int16 pairs and converted to fp16 before the MMA layout change
(`fp8_convert`: 1.2-1.3x over a plain `.to()` at 2-16 rows). One row of x (batch 1) takes
`_fp8_gemv_kernel` instead: no tensor cores, two weight rows a program, 2.3-3.4 TB/s of
weight on an H200 where the tl.dot kernel reached 1.2-2.7 (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kernels import fp8_convert, pdl
from pagellm.kernels.fp8_convert import fp8_pairs_to_f16, load_fp8_pairs

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
SCALE_BLOCK = 128  # rows and columns of one block scale


@triton.jit
def _quantize_kernel(
    x_ptr,  # [M, K] bf16 / fp16 / fp32
    q_ptr,  # [M, K] fp8
    s_ptr,  # [M, K / GROUP] float32
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per (row, group): scale = amax / 448, q = x / scale
    row = tl.program_id(0)
    start = tl.program_id(1) * GROUP
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for off in range(0, GROUP, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        mask = (off + tl.arange(0, BLOCK) < GROUP) & (cols < K)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
    for off in range(0, GROUP, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        mask = (off + tl.arange(0, BLOCK) < GROUP) & (cols < K)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + tl.program_id(1), scale)


def quantize_fp8(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic fp8 quantization of x [M, K] per row (`group` None) or per (row, `group`
    columns): (q fp8 [M, K], scale float32 [M, K / group]) with x ~ q * scale."""
    m, k = x.shape
    group = group or k
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        block = min(triton.next_power_of_2(group), 1024)
        _quantize_kernel[(m, groups)](
            x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0), GROUP=group, BLOCK=block
        )
    return q, scale


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,  # [M, K] bf16 (weight-only) or fp8 (A_FP8)
    a_scale_ptr,  # A_FP8: [M, K / 128] (block) or [M, 1] float32
    w_ptr,  # [N, K] fp8
    w_scale_ptr,  # [N] or [N / 128, K / 128] float32
    bias_ptr,  # [N]
    c_ptr,  # [M, N]
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_wn,
    stride_wsn,
    stride_cm,
    A_FP8: tl.constexpr,
    W_BLOCK: tl.constexpr,  # 0: per-row scales; 128: block scales (BLOCK_K == 128)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_PAIRS: tl.constexpr = False,  # weight-only: w read as int16 pairs (`fp8_convert`)
    PTX_CVT: tl.constexpr = False,  # W_PAIRS converted by PTX (compiled; not interpreted)
):
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    w_rows = rn.to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (checked by the wrapper)
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        if A_FP8:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            part = tl.dot(a, tl.trans(w))
        else:
            if W_PAIRS:
                w = fp8_pairs_to_f16(load_fp8_pairs(w_ptr, w_rows + k0, n_ok, BLOCK_K), 1, PTX_CVT)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            part = tl.dot(a, tl.trans(w.to(a.dtype)))
        if W_BLOCK:
            kb = k0 // W_BLOCK
            ws = tl.load(w_scale_ptr + (rn // W_BLOCK) * stride_wsn + kb, mask=n_ok, other=0.0)
            if A_FP8:
                xs = tl.load(a_scale_ptr + rm * stride_asm + kb, mask=m_ok, other=0.0)
                part = part * xs[:, None]
            acc += part * ws[None, :]
        else:
            acc += part
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not W_BLOCK:
        acc = acc * tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
        if A_FP8:
            acc = acc * tl.load(a_scale_ptr + rm * stride_asm, mask=m_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv_step(acc, w, x_ptrs, w_scale_ptr, rn, n_ok, k0, stride_wsn, W_BLOCK: tl.constexpr):
    """acc + one K step of the GEMV: the fp8 weight tile `w` times x at `x_ptrs`."""
    x = tl.load(x_ptrs).to(tl.float32)
    if W_BLOCK:  # BLOCK_K == W_BLOCK: one scale per row and step
        ws = tl.load(w_scale_ptr + (rn // W_BLOCK) * stride_wsn + k0 // W_BLOCK, mask=n_ok,
                     other=0.0)  # fmt: skip
        return acc + (w.to(tl.float32) * x) * ws[:, None]
    return acc + w.to(tl.float32) * x


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [K] bf16 / fp16 / fp32: one activation row
    w_ptr,  # [N, K] fp8
    w_scale_ptr,  # [N] or [N / 128, K / 128] float32
    bias_ptr,  # [N]
    c_ptr,  # [N]
    N,
    K,
    stride_wn,
    stride_wsn,
    W_BLOCK: tl.constexpr,  # 0: per-row scales; 128: block scales
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,  # launched early (`pagellm.kernels.pdl`): x only after the wait
):
    # One program streams BLOCK_N weight rows, BLOCK_K bytes of each per step (16-byte loads,
    # fp8 -> f16x2 -> f32 in registers), on the CUDA cores: products summed per lane in a
    # [BLOCK_N, BLOCK_K] accumulator, reduced across lanes once, after the loop. With PDL the
    # grid is launched while the kernel before it runs and waits for it before the loop:
    # that hides the launch (+2.6% at batch 1). Loading the first weight tile before the
    # wait, as a peeled first step, cost 7%; a one-step look-ahead in the loop cost 16%.
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    # x through [BLOCK_N, BLOCK_K] pointers, the w tile's layout: each lane loads the x
    # values it multiplies (repeats hit L1), so no layout change through shared memory
    x_ptrs = x_ptr + rk[None, :] + 0 * rn[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    pdl.wait_for_predecessor(PDL)  # x is the previous kernel's output
    for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (checked by the wrapper)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        acc = _gemv_step(acc, w, x_ptrs, w_scale_ptr, rn, n_ok, k0, stride_wsn, W_BLOCK)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    if not W_BLOCK:
        out = out * tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(c_ptr + rn, out.to(c_ptr.dtype.element_ty), mask=n_ok)


def gemv_config(n: int, k: int, block: int) -> dict:
    """Tiles of the one-row kernel: 2 weight rows a program (N / 2 programs: ~4 waves of
    the SMs' slots even for N = 4096), 1024 bytes of each a step with 2 warps, 2048 with 4
    where K >= 8192; block scales fix BLOCK_K at 128. From `benchmarks/gemm.py --fp8-sweep`
    at Llama-3.1-8B shapes (H200): 2.3-3.4 TB/s of weight against 1.8-3.2 for 8-row tiles."""
    if block:
        return dict(GEMV=True, BLOCK_N=32, BLOCK_K=block, num_warps=4, num_stages=1)
    block_k, warps = (2048, 4) if k >= 8192 else (1024, 2)
    while k % block_k:
        block_k //= 2
    return dict(GEMV=True, BLOCK_N=2, BLOCK_K=block_k, num_warps=warps, num_stages=1)


def gemm_config(m: int, n: int, k: int, block: int) -> dict:
    """Tiles for one call. Decode sizes (m <= 16): one M tile of 16 and narrow N tiles, so
    that N / BLOCK_N programs each stream a few weight rows, 2 warps; wide N (gate_up): 32 x
    128 steps, 3 stages, else 16 x 512, 5 stages (`benchmarks/gemm.py --fp8-sweep --rows 16`,
    Llama-3.1-8B shapes, H200: 2.0-3.35 TB/s against 1.4-3.3 for 16 x 256 with 4 warps);
    larger m: 64 x 128 tiles. Block scales fix BLOCK_K at 128."""
    if m <= 16:
        wide = n >= 8192
        cfg = dict(BLOCK_M=16, BLOCK_N=32 if wide else 16, BLOCK_K=128 if wide else 512)
        cfg.update(num_warps=2, num_stages=3 if wide else 5)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)
    if block:
        cfg["BLOCK_K"] = block
    while k % cfg["BLOCK_K"]:
        cfg["BLOCK_K"] //= 2
    return cfg


def fp8_gemm(
    x: torch.Tensor,  # [M, K] bf16 / fp16 (weight-only) or fp8 (with x_scale)
    w: torch.Tensor,  # [N, K] fp8
    w_scale: torch.Tensor,  # [N] or [ceil(N / 128), ceil(K / 128)] float32
    bias: torch.Tensor | None = None,  # [N]
    x_scale: torch.Tensor | None = None,  # fp8 x: [M, 1] (per-row w) or [M, K / 128] (block w)
    out_dtype: torch.dtype = torch.bfloat16,
    config: dict | None = None,
) -> torch.Tensor:  # [M, N]
    m, k = x.shape
    n = w.shape[0]
    block = SCALE_BLOCK if w_scale.dim() == 2 else 0
    _check(x, w, w_scale, x_scale, block)
    if config is None and x_scale is None and m == 1:
        config = gemv_config(n, k, block)
    cfg = dict(config or gemm_config(m, n, k, block))
    if k % cfg["BLOCK_K"] or k % 16:
        raise ValueError(f"fp8_gemm: K={k} must be a multiple of 16 and of BLOCK_K")
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    a_fp8 = x_scale is not None
    if cfg.pop("GEMV", False):  # one bf16 row: the CUDA-core kernel
        if a_fp8 or m != 1:
            raise ValueError("fp8_gemm: a GEMV config takes one bf16 / fp16 row of x")
        use_pdl = pdl.enabled(x.device)
        _fp8_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
            x, w, w_scale, bias if bias is not None else w_scale, out, n, k, w.stride(0),
            w_scale.stride(0) if block else 0, W_BLOCK=block, HAS_BIAS=bias is not None,
            PDL=use_pdl, launch_pdl=use_pdl, **cfg,
        )  # fmt: skip
        return out
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    if not a_fp8 and fp8_convert.ENABLED:
        cfg.update(W_PAIRS=True, PTX_CVT=w.device.type == "cuda")  # the interpreter: no PTX
    _fp8_gemm_kernel[grid](
        x, x_scale if a_fp8 else w_scale, w, w_scale, bias if bias is not None else w_scale, out,
        m, n, k, x.stride(0), x_scale.stride(0) if a_fp8 else 0, w.stride(0),
        w_scale.stride(0) if block else 0, out.stride(0),
        A_FP8=a_fp8, W_BLOCK=block, HAS_BIAS=bias is not None, **cfg,
    )  # fmt: skip
    return out


def _check(x, w, w_scale, x_scale, block: int) -> None:
    if w.dtype != FP8 or w.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("fp8_gemm: w must be float8_e4m3fn; w and x contiguous along K")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"fp8_gemm: x {tuple(x.shape)} and w {tuple(w.shape)} differ in K")
    if (x_scale is None) != (x.dtype != FP8):
        raise ValueError("fp8_gemm: an fp8 x needs x_scale, a bf16 / fp16 x none")
    n, k = w.shape
    want = (triton.cdiv(n, block), triton.cdiv(k, block)) if block else (n,)
    if tuple(w_scale.shape) != want or w_scale.dtype != torch.float32:
        raise ValueError(f"fp8_gemm: w_scale must be float32 {want}, got {tuple(w_scale.shape)}")
