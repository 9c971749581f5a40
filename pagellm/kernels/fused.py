"""Fused small ops of the decoder layer (Triton): RMSNorm (+ residual add), rotary, SiLU-and-mul,
and Qwen3's per-head q/k RMSNorm followed by rotary (`qk_norm_rotary`, one kernel for four).
RMSNorm and SiLU-and-mul also come with an fp8 output (`rms_norm_fp8`, `silu_and_mul_fp8`):
the w8a8 GEMM after them takes its input quantized (e4m3 and per-token or per-128-column
scales) instead of quantizing it in a kernel of its own.

In eager PyTorch each of these is 3-9 elementwise kernels; a decode step of a small model
is then mostly launch gaps (Qwen3-0.6B: ~35 tiny kernels per layer, about 4 ms of an H200
decode step at batch 256). Each op here is one kernel, one program per token.

Rounding follows the torch path (and HF) where it rounds to the activation dtype between
ops: the residual sum, the normalized value before the weight multiply, and SiLU's output
before the multiply are rounded as torch rounds them. Rotary is computed in fp32 with one
rounding at the end (torch rounds after each multiply; the difference is below bf16's step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kernels import pdl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, heads, n] (any token / head strides, contiguous n)
    res_ptr,  # [T, n] residual to add first (HAS_RES)
    w_ptr,  # [n]
    out_ptr,  # [T, heads, n] contiguous
    res_out_ptr,  # [T, n] contiguous: x + residual (HAS_RES)
    heads,
    n,
    stride_xt,
    stride_xh,
    stride_rt,
    eps,
    HEADS_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RES: tl.constexpr,
    PDL: tl.constexpr = False,  # launched early; the next kernel (a GEMV) too (`kernels.pdl`)
    FP8_GROUP: tl.constexpr = 0,  # > 0 (heads == 1): out is fp8, scales of FP8_GROUP columns
    scale_ptr=None,  # FP8_GROUP: [T, cdiv(n, FP8_GROUP)] float32
    stride_st=0,
    WEIGHT_FIRST: tl.constexpr = False,  # Gemma: times the weight in float32, rounded once
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs = tl.arange(0, BLOCK)
    mask = (offs_h[:, None] < heads) & (offs[None, :] < n)  # [HEADS_PAD, BLOCK]
    w = tl.load(w_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)  # no kernel's output
    pdl.wait_for_predecessor(PDL)  # x is the kernel before's output
    pdl.launch_dependents(PDL)
    x_offs = t * stride_xt + offs_h[:, None] * stride_xh + offs[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    out_offs = (t * heads + offs_h[:, None]) * n + offs[None, :]
    if HAS_RES:  # heads == 1
        r = tl.load(res_ptr + t * stride_rt + offs[None, :], mask=mask, other=0.0)
        x = (x + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)  # rounded, as torch adds
        tl.store(res_out_ptr + out_offs, x, mask=mask)
        x = x.to(tl.float32)
    var = tl.sum(x * x, 1) / n  # [HEADS_PAD]
    y = x * tl.rsqrt(var + eps)[:, None]
    dtype = x_ptr.dtype.element_ty  # the activations': the unfused norm's output dtype
    if not WEIGHT_FIRST:
        y = y.to(dtype).to(tl.float32)  # HF's Llama: normalized, rounded, then * weight
    y = (y * w[None, :]).to(dtype)
    if FP8_GROUP:  # quantized as `fp8_gemm.quantize_fp8` quantizes the unfused norm's output
        groups = tl.arange(0, BLOCK // FP8_GROUP)
        if FP8_GROUP == BLOCK:  # a scale a row: the tile [1, BLOCK] is the group
            scale = quantize_fp8_groups(y, out_ptr + out_offs, mask)
        else:  # [BLOCK / FP8_GROUP, FP8_GROUP] groups of the row
            cols = groups[:, None] * FP8_GROUP + tl.arange(0, FP8_GROUP)[None, :]
            y = tl.reshape(y, [BLOCK // FP8_GROUP, FP8_GROUP])
            scale = quantize_fp8_groups(y, out_ptr + t * n + cols, cols < n)
        tl.store(scale_ptr + t * stride_st + groups, scale, mask=groups * FP8_GROUP < n)
    else:
        tl.store(out_ptr + out_offs, y, mask=mask)


@triton.jit
def rotate_halves(x1, x2, cs_ptr, offs, HALF: tl.constexpr):
    """NeoX rotary of a head's two halves (float32) at the rotated dims `offs` (< HALF), the
    token's cos | sin row at `cs_ptr`: (x1 cos - x2 sin, x2 cos + x1 sin) in float32."""
    cos = tl.load(cs_ptr + offs).to(tl.float32)
    sin = tl.load(cs_ptr + HALF + offs).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rotary_kernel(
    x_ptr,  # [T, heads, 2 * HALF] (any token / head strides)
    cs_ptr,  # [T, 1, 2 * HALF]: cos | sin
    out_ptr,  # [T, heads, 2 * HALF] contiguous
    heads,
    stride_xt,
    stride_xh,
    stride_ct,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs = tl.arange(0, HALF)[None, :]
    mask = offs_h < heads
    x1_ptr = x_ptr + t * stride_xt + offs_h * stride_xh + offs
    x1 = tl.load(x1_ptr, mask=mask, other=0.0).to(tl.float32)  # [HEADS_PAD, HALF]
    x2 = tl.load(x1_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    y1, y2 = rotate_halves(x1, x2, cs_ptr + t * stride_ct, offs, HALF)
    o_ptr = out_ptr + (t * heads + offs_h) * (2 * HALF) + offs
    dtype = out_ptr.dtype.element_ty
    tl.store(o_ptr, y1.to(dtype), mask=mask)
    tl.store(o_ptr + HALF, y2.to(dtype), mask=mask)


@triton.jit
def _qk_norm_rotary_kernel(
    qkv_ptr,  # [T, H + 2 * H_kv, 2 * HALF] (any token stride; heads contiguous)
    q_w_ptr,  # [2 * HALF] q_norm weight
    k_w_ptr,  # [2 * HALF] k_norm weight
    cs_ptr,  # [T, 1, 2 * HALF]: cos | sin
    q_out_ptr,  # [T, H, 2 * HALF] contiguous
    k_out_ptr,  # [T, H_kv, 2 * HALF] contiguous
    num_heads,
    num_kv_heads,
    stride_t,
    stride_ct,
    eps,
    HEADS_PAD: tl.constexpr,  # >= H + H_kv
    HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]  # q heads, then k heads
    offs = tl.arange(0, HALF)[None, :]
    mask = h < num_heads + num_kv_heads
    x1_ptr = qkv_ptr + t * stride_t + h * (2 * HALF) + offs
    x1 = tl.load(x1_ptr, mask=mask, other=0.0).to(tl.float32)  # [HEADS_PAD, HALF]
    x2 = tl.load(x1_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    # RMSNorm per head, rounded as the torch path rounds (see the module doc)
    dtype = q_out_ptr.dtype.element_ty
    inv_rms = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    is_q = h < num_heads
    w1 = tl.where(is_q, tl.load(q_w_ptr + offs), tl.load(k_w_ptr + offs)).to(tl.float32)
    w2 = tl.where(is_q, tl.load(q_w_ptr + HALF + offs), tl.load(k_w_ptr + HALF + offs))
    w2 = w2.to(tl.float32)
    x1 = ((x1 * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    x2 = ((x2 * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    # then rotary, in fp32 with one rounding
    y1, y2 = rotate_halves(x1, x2, cs_ptr + t * stride_ct, offs, HALF)
    y1, y2 = y1.to(dtype), y2.to(dtype)
    q_ptr = q_out_ptr + (t * num_heads + h) * (2 * HALF) + offs
    tl.store(q_ptr, y1, mask=is_q)
    tl.store(q_ptr + HALF, y2, mask=is_q)
    k_ptr = k_out_ptr + (t * num_kv_heads + h - num_heads) * (2 * HALF) + offs
    k_mask = mask & (h >= num_heads)
    tl.store(k_ptr, y1, mask=k_mask)
    tl.store(k_ptr + HALF, y2, mask=k_mask)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2 * n]: gate | up
    out_ptr,  # [T, n]
    n,
    stride_xt,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # as _rms_norm_kernel's
):
    pdl.launch_dependents(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = _silu_mul(x_ptr + t * stride_xt, offs, mask, n, out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * n + offs, y, mask=mask)


@triton.jit
def fp8_scale(amax):
    """The e4m3 scale of activations whose largest magnitude is `amax`: amax / 448 (at least
    1e-12), as every dynamic fp8 quantization here takes it (`fp8_gemm.quantize_fp8` too)."""
    return tl.maximum(amax, 1e-12) / 448.0


@triton.jit
def to_fp8(y, scale, dtype):
    """y / scale, saturated to e4m3's range, in `dtype` (float8_e4m3fn)."""
    return tl.clamp(y / scale, -448.0, 448.0).to(dtype)


@triton.jit
def quantize_fp8_groups(y, q_ptrs, mask):
    """Store y [GROUPS, GROUP] (0 where not `mask`) as e4m3 at `q_ptrs`, each row of the
    tile (a group of columns) with its own `fp8_scale`; returns the GROUPS scales."""
    y = y.to(tl.float32)
    scale = fp8_scale(tl.max(tl.abs(y), 1))
    tl.store(q_ptrs, to_fp8(y, scale[:, None], q_ptrs.dtype.element_ty), mask=mask)
    return scale


@triton.jit
def _silu_mul(x_ptr, offs, mask, n, dtype: tl.constexpr):
    """silu(gate) * up at columns `offs` of one gate | up row, rounded as torch rounds it."""
    gate = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + n + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)  # rounded, as F.silu returns it
    return (act * up).to(dtype)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr,  # [T, 2 * n]: gate | up
    q_ptr,  # [T, n] fp8
    scale_ptr,  # [T, 1] (GROUP 0) or [T, n / GROUP] float32
    n,
    stride_xt,
    stride_st,
    GROUP: tl.constexpr,  # columns a scale; 0: one scale a row, two passes over it
    BLOCK: tl.constexpr,  # columns a program (whole groups), or a pass step (GROUP 0)
):
    t = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + t * stride_xt
    dtype = x_ptr.dtype.element_ty
    if GROUP:  # this program's BLOCK columns as a [BLOCK / GROUP, GROUP] tile of groups
        groups = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
        offs = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        y = _silu_mul(x_row, offs, offs < n, n, dtype)
        scale = quantize_fp8_groups(y, q_ptr + t * n + offs, offs < n)
        tl.store(scale_ptr + t * stride_st + groups, scale, mask=groups * GROUP < n)
    else:  # the row's amax first, then the values (recomputed: two reads of x, one write)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            y = _silu_mul(x_row, offs, offs < n, n, dtype).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(y))
        scale = fp8_scale(tl.max(amax, 0))
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            y = _silu_mul(x_row, offs, offs < n, n, dtype).to(tl.float32)
            tl.store(q_ptr + t * n + offs, to_fp8(y, scale, q_ptr.dtype.element_ty), mask=offs < n)
        tl.store(scale_ptr + t * stride_st, scale)


def _num_warps(elements: int) -> int:
    return max(1, min(8, triton.next_power_of_2(elements) // 512))


def rms_norm(
    x: torch.Tensor,  # [T, n] or [T, heads, n]; contiguous in n
    weight: torch.Tensor,  # [n]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, n]: added to x first (x must be 2-D)
    weight_first: bool = False,  # Gemma's order: x / rms(x) * weight in float32, one rounding
) -> tuple[torch.Tensor, torch.Tensor | None]:  # (normed like x, x + residual or None)
    """HF's RMSNorm (Llama's order: the normalized x rounded to x's dtype, then times the
    weight), or Gemma's with `weight_first`."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out, _rms_norm(x, weight, eps, residual, out, weight_first=weight_first)


def rms_norm_fp8(
    x: torch.Tensor,  # [T, n]; contiguous in n
    weight: torch.Tensor,  # [n]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, n]
    group: int = 0,  # 0: one scale a row; else a scale per `group` columns (n % group == 0)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # (q, scale, x + residual)
    """`fp8_gemm.quantize_fp8(rms_norm(x, weight, eps, residual)[0], group)` in one kernel,
    bit for bit: the norm's output goes to the GEMM after it as fp8 (e4m3) and its scales."""
    t, n = x.shape
    q, scale = _fp8_outputs("rms_norm_fp8", t, n, group, x.device)
    res_out = _rms_norm(x, weight, eps, residual, q, group or triton.next_power_of_2(n), scale)
    return q, scale, res_out


def _fp8_outputs(op: str, t: int, n: int, group: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The e4m3 values [t, n] and float32 scales ([t, 1], or [t, n / group]) an fp8-output
    op writes; `group` checked first."""
    if group and (n % group or group & (group - 1)):
        raise ValueError(f"{op}: group {group} must be a power of two dividing {n}")
    q = torch.empty((t, n), dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty((t, n // group if group else 1), dtype=torch.float32, device=device)
    return q, scale


def _rms_norm(x, weight, eps, residual, out, fp8_group: int = 0, scale=None, weight_first=False):
    """Launch `_rms_norm_kernel` into `out`; returns x + residual (None without one)."""
    n = x.shape[-1]
    if x.stride(-1) != 1 or weight.shape != (n,):
        raise ValueError(
            f"rms_norm: x {tuple(x.shape)} (stride(-1) must be 1), weight {tuple(weight.shape)}"
        )
    x3 = x if x.dim() == 3 else x.unsqueeze(1)  # [T, heads, n]
    heads = x3.shape[1]
    if residual is not None and (
        heads != 1 or residual.shape != x.shape or residual.stride(-1) != 1
    ):
        raise ValueError("rms_norm: residual must match a 2-D x and be contiguous in its last dim")
    res_out = torch.empty_like(x) if residual is not None else None
    res = residual if residual is not None else x
    use_pdl = pdl.enabled(x.device)
    _rms_norm_kernel[(x3.shape[0],)](
        x3, res, weight, out, res_out if res_out is not None else out,
        heads, n, x3.stride(0), x3.stride(1), res.stride(0), eps,
        HEADS_PAD=triton.next_power_of_2(heads),
        BLOCK=triton.next_power_of_2(n),
        HAS_RES=residual is not None,
        PDL=use_pdl,
        FP8_GROUP=fp8_group,
        scale_ptr=scale,
        stride_st=scale.stride(0) if scale is not None else 0,
        WEIGHT_FIRST=weight_first,
        launch_pdl=use_pdl,
        num_warps=_num_warps(heads * n),
    )  # fmt: skip
    return res_out


def rotary(
    x: torch.Tensor,  # [T, heads, D]; contiguous in D, D a power of two >= 4
    cos_sin: torch.Tensor,  # [T, 1, D]: cos | sin, in x's dtype
) -> torch.Tensor:  # [T, heads, D] contiguous
    t, heads, d = x.shape
    if x.stride(-1) != 1 or cos_sin.shape != (t, 1, d) or cos_sin.stride(-1) != 1:
        raise ValueError(f"rotary: x {tuple(x.shape)}, cos_sin {tuple(cos_sin.shape)}")
    if d < 4 or d & (d - 1):
        raise ValueError(f"rotary: head_dim must be a power of two >= 4, got {d}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rotary_kernel[(t,)](
        x, cos_sin, out, heads, x.stride(0), x.stride(1), cos_sin.stride(0),
        HEADS_PAD=triton.next_power_of_2(heads), HALF=d // 2,
        num_warps=_num_warps(heads * d),
    )  # fmt: skip
    return out


def qk_norm_rotary(
    qkv: torch.Tensor,  # [T, H + 2 * H_kv, D]; heads contiguous
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    cos_sin: torch.Tensor,  # [T, 1, D]: cos | sin, in qkv's dtype
    num_heads: int,
    num_kv_heads: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, H, D], k [T, H_kv, D], both contiguous
    """`rotary(rms_norm(q, q_weight))` and the same for k, in one kernel (Qwen3)."""
    t, heads, d = qkv.shape
    if heads != num_heads + 2 * num_kv_heads or qkv.stride(2) != 1 or qkv.stride(1) != d:
        raise ValueError(f"qk_norm_rotary: qkv {tuple(qkv.shape)} for {num_heads}/{num_kv_heads}")
    if q_weight.shape != (d,) or k_weight.shape != (d,) or not supports_rotary(d):
        raise ValueError(f"qk_norm_rotary: weights {tuple(q_weight.shape)}, head_dim {d}")
    if cos_sin.shape != (t, 1, d) or cos_sin.stride(-1) != 1:
        raise ValueError(f"qk_norm_rotary: cos_sin {tuple(cos_sin.shape)}")
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, num_kv_heads, d), dtype=qkv.dtype, device=qkv.device)
    heads_pad = triton.next_power_of_2(num_heads + num_kv_heads)
    _qk_norm_rotary_kernel[(t,)](
        qkv, q_weight, k_weight, cos_sin, q, k, num_heads, num_kv_heads,
        qkv.stride(0), cos_sin.stride(0), eps, HEADS_PAD=heads_pad, HALF=d // 2,
        num_warps=_num_warps(heads_pad * d),
    )  # fmt: skip
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2 * n] (gate | up) -> [T, n]
    t, n = x.shape[0], x.shape[1] // 2
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul: expected [T, 2 * n] contiguous rows, got {tuple(x.shape)}")
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(n), 2048)
    _silu_and_mul_kernel[(t, triton.cdiv(n, block))](
        x, out, n, x.stride(0), BLOCK=block, PDL=pdl.enabled(x.device),
        num_warps=_num_warps(block),
    )  # fmt: skip
    return out


# the longest row `silu_and_mul_fp8` quantizes per row in one pass (Llama-3.1-8B: 14,336):
# 17.3 us a call with two passes over chunks of 2048 at 256 rows on an H200 (latency-bound)
SILU_FP8_ROW = 16384


def silu_and_mul_fp8(
    x: torch.Tensor,  # [T, 2 * n] (gate | up)
    group: int = 0,  # 0: one scale a row; else a scale per `group` columns (n % group == 0)
) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, n] e4m3, scale [T, 1] or [T, n / group]
    """`fp8_gemm.quantize_fp8(silu_and_mul(x), group)` in one kernel, bit for bit."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul_fp8: expected [T, 2 * n] rows, got {tuple(x.shape)}")
    t, n = x.shape[0], x.shape[1] // 2
    q, scale = _fp8_outputs("silu_and_mul_fp8", t, n, group, x.device)
    row = triton.next_power_of_2(n)
    if not group and row <= SILU_FP8_ROW:  # a row a program, in registers: one pass
        block, kernel_group = row, row
    else:  # blocks of whole groups a program; or rows too long for one pass: two passes
        block, kernel_group = max(group, min(row, 2048)), group
    _silu_and_mul_fp8_kernel[(t, triton.cdiv(n, block) if kernel_group else 1)](
        x, q, scale, n, x.stride(0), scale.stride(0), GROUP=kernel_group, BLOCK=block,
        num_warps=16 if block >= 8192 else _num_warps(block),
    )  # fmt: skip
    return q, scale


def supports_rotary(head_dim: int) -> bool:
    return head_dim >= 4 and head_dim & (head_dim - 1) == 0
