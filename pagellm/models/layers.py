"""Building blocks shared by the decoder models: norms, rotary embedding, the gated MLP and
the `Attention` layer that owns one attention-backend instance; the linear layers
(`pagellm/models/linear.py`) and the vocabulary layers (`vocab_embedding.py`) are re-exported.

A model built from these shards over tensor-parallel ranks by construction: projections into
heads or MLP columns are column-parallel, projections out of them row-parallel, and the
`Attention` layer gets this rank's heads (`heads_per_rank`).

Models are built on the `meta` device; weights arrive through `load_weights` (see
`pagellm/models/weights.py`), which assigns real tensors in place of the meta parameters.

RMSNorm (+ residual add), rotary and SiLU-and-mul run as one Triton kernel each on CUDA
(`pagellm/kernels/fused.py`) and as one C++ loop each on the CPU (`pagellm/kernels/cpu_fused.py`);
the plain torch ops are the reference path (PAGELLM_CPU_FUSED_OPS=0, or no compiler).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.base import AttentionBackend
from pagellm.kernels import cpu_fused
from pagellm.kv_cache_dtype import first_batch_scales
from pagellm.models.linear import (  # noqa: F401  (re-exported for the models)
    ColumnParallelLinear,
    FusedLinear,
    Linear,
    PackedWeight,
    QKVParallelLinear,
    RowParallelLinear,
    cpu_prepack_supported,
    heads_per_rank,
)
from pagellm.models.rope import cos_sin_table
from pagellm.models.vocab_embedding import (  # noqa: F401  (re-exported for the models)
    ParallelLMHead,
    VocabParallelEmbedding,
    gather_logits,
)
from pagellm.quantization.base import QuantizedActivation, QuantizedWeight


@functools.cache
def _fused_module():
    try:
        from pagellm.kernels import fused
    except ImportError:  # no Triton: plain torch everywhere
        return None
    return fused


def _fused_ops(x: torch.Tensor):
    """The fused ops for x's device: Triton's on CUDA, the C++ ones on the CPU (float32 and
    bf16, where they could be built); None: the torch path."""
    if x.is_cuda:
        return _fused_module()
    if cpu_fused.supports(x):
        return cpu_fused
    return None


def _fp8_input_group(x: torch.Tensor, columns: int, quant_for: Any) -> int | None:
    """The fp8 quantization (`QuantizedWeight.input_quantization`) that `quant_for`, the
    weight of the GEMM after this op, wants for an input of x's rows and `columns` columns,
    where the op's Triton kernel can write it (2-D x, whole groups); None: hand it x as it
    is. (Weights that take fp8 input run Triton kernels themselves: CUDA, or the
    interpreter in tests.)"""
    if not isinstance(quant_for, QuantizedWeight) or x.dim() != 2 or x.stride(-1) != 1:
        return None
    group = quant_for.input_quantization(x.shape[0])
    if group is None or (group and columns % group) or _fused_module() is None:
        return None
    return group


class RMSNorm(nn.Module):
    """y = w * x / rms(x), computed in float32 and cast back (as HF does).

    `quant_for`: the weight of the GEMM the output feeds; where it takes fp8 input (w8a8
    `quantization="fp8"` at batch > 16) the norm's kernel writes it quantized
    (`QuantizedActivation`), bit for bit what that GEMM's own quantization would produce."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, quant_for: Any = None) -> torch.Tensor | QuantizedActivation:
        # x: [..., size]
        quantized = self._quantized(x, None, quant_for)
        if quantized is not None:
            return quantized[0]
        fused = self._fused(x)
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps)[0]
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None, quant_for: Any = None
    ) -> tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
        """Add the residual stream first (None: x is the stream, as before a model's first
        layer); return (normed, new residual)."""
        if residual is None:
            return self.forward(x, quant_for), x
        quantized = self._quantized(x, residual, quant_for)
        if quantized is not None:
            return quantized
        fused = self._fused(x)
        if fused is not None and x.dim() == 2:
            return fused.rms_norm(x, self.weight, self.eps, residual)
        residual = x + residual
        return self.forward(residual), residual

    def _quantized(self, x, residual, quant_for) -> tuple[QuantizedActivation, Any] | None:
        """(the output quantized for `quant_for`, x + residual) from one Triton kernel where
        that weight takes fp8 input; None otherwise."""
        group = _fp8_input_group(x, x.shape[-1], quant_for)
        if group is None or self.weight.dtype != x.dtype:
            return None
        q, scale, res = _fused_module().rms_norm_fp8(x, self.weight, self.eps, residual, group)
        return QuantizedActivation(q, scale, x.dtype), res

    def _fused(self, x: torch.Tensor):
        fused = _fused_ops(x)
        ok = fused is not None and self.weight.dtype == x.dtype and x.stride(-1) == 1
        return fused if ok and x.dim() in (2, 3) else None


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding with a precomputed cos/sin table per position.

    `rope_scaling` follows HF: None / "default", "linear", "llama3", "yarn", "dynamic" or
    "longrope" with their parameters (see `pagellm/models/rope.py`); `head_dim` is the number
    of rotated dims (less than the head's with partial rotary).
    """

    def __init__(
        self, head_dim: int, max_position: int, theta: float, rope_scaling: dict | None = None
    ) -> None:
        super().__init__()
        table = cos_sin_table(head_dim, max_position, theta, rope_scaling)  # [max_position, D]
        self.register_buffer("cos_sin", table, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # positions: [T] -> [T, 1, D] (cos | sin), broadcastable over heads
        return self.cos_sin.index_select(0, positions).to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos_sin: [T, 1, R] -> [T, H, D]; R < D: partial rotary, the rest passes
    rot = cos_sin.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rot], cos_sin), x[..., rot:]], dim=-1)
    fused = _fused_ops(x)
    if fused is not None and fused.supports_rotary(x.shape[-1]) and x.stride(-1) == 1:
        return fused.rotary(x, cos_sin.contiguous())
    cos, sin = cos_sin.chunk(2, dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def qk_norm_rotary(
    qkv: torch.Tensor,  # [T, H + 2 * H_kv, D]
    q_norm: RMSNorm,
    k_norm: RMSNorm,
    cos_sin: torch.Tensor,  # [T, 1, D]
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, H, D], k [T, H_kv, D]
    """Qwen3's per-head RMSNorm of q and k, then rotary: one Triton kernel on CUDA (on the
    CPU the norm's and the rotary's C++ ops, two calls each)."""
    fused = _fused_ops(qkv) if qkv.is_cuda else None
    d = qkv.shape[-1]
    if (
        fused is not None
        and fused.supports_rotary(d)
        and qkv.stride(-1) == 1
        and qkv.stride(1) == d
        and q_norm.weight.dtype == k_norm.weight.dtype == qkv.dtype
        and q_norm.eps == k_norm.eps
    ):
        weights = (q_norm.weight, k_norm.weight)
        return fused.qk_norm_rotary(
            qkv, *weights, cos_sin.contiguous(), num_heads, num_kv_heads, q_norm.eps
        )
    q, k, _ = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    return apply_rotary(q_norm(q), cos_sin), apply_rotary(k_norm(k), cos_sin)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor, quant_for: Any = None) -> torch.Tensor | QuantizedActivation:
        # x: [T, 2 * I] (gate | up) -> [T, I]; quantized for `quant_for` as RMSNorm's output
        group = _fp8_input_group(x, x.shape[-1] // 2, quant_for)
        if group is not None:
            return QuantizedActivation(*_fused_module().silu_and_mul_fp8(x, group), x.dtype)
        fused = _fused_ops(x)
        if fused is not None and x.dim() == 2 and x.stride(-1) == 1:
            return fused.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """GeGLU (Gemma): gelu(gate) * up, gelu with its tanh approximation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, 2 * I] (gate | up) -> [T, I]
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


# HF `hidden_act` / `hidden_activation` -> the gated activation of the MLP
GATED_ACTIVATIONS = {
    "silu": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
    "gelu_tanh": GeluTanhAndMul,
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul; act is SiLU, or
    gelu-tanh for Gemma's GeGLU. Each rank holds 1/tp of the intermediate columns (gate_up
    column-parallel, down row-parallel)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu"
    ) -> None:
        super().__init__()
        if act not in GATED_ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not supported: {sorted(GATED_ACTIVATIONS)}")
        shards = {"gate_proj": intermediate_size, "up_proj": intermediate_size}
        self.gate_up_proj = FusedLinear(hidden_size, shards, bias=bias)
        self.act_fn = GATED_ACTIVATIONS[act]()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        # x: [T, hidden] (or quantized for gate_up by the norm before) -> [T, hidden]
        weight = self.gate_up_proj.packed_weight
        if isinstance(self.act_fn, SiluAndMul) and isinstance(weight, QuantizedWeight):
            # a quantized gate | up may fuse the activation into its GEMM (fp8 at batch 1)
            h = weight.silu_and_mul(x, self.gate_up_proj.bias)
            if h is not None:
                return self.down_proj(h)
            # the activation's kernel may quantize for down_proj (fp8 w8a8)
            return self.down_proj(self.act_fn(self.gate_up_proj(x), self.down_proj.packed_weight))
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Attention(nn.Module):
    """Paged attention through one instance of the model's attention backend.

    `scale` multiplies q.k (default head_dim ** -0.5); `sliding_window` W: a query sees only
    the keys of its last W positions, itself included (HF's `sliding_window`);
    `logits_soft_cap` c: scores become c * tanh(score / c) before the softmax.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        attn_backend_cls: type[AttentionBackend],
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.sliding_window = sliding_window  # read by the runner: may window blocks be freed?
        scale = head_dim**-0.5 if scale is None else scale
        self.impl = attn_backend_cls(
            num_heads, num_kv_heads, head_dim, scale,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        )  # fmt: skip
        # [k_scale, v_scale] of an fp8 KV cache (pagellm.kv_cache_dtype): built on
        # the CPU (the model is built on `meta`), moved with the model
        ones = torch.ones(2, dtype=torch.float32, device="cpu")
        self.register_buffer("kv_scale", ones, persistent=False)
        self.calculate_kv_scales = False  # the runner sets it for the first batch's forward

    def load_kv_scale(self, which: tuple[int, ...], tensor: torch.Tensor) -> None:
        """A checkpoint's k_scale / v_scale (`which`: 0 for k, 1 for v)."""
        value = float(tensor.float().reshape(-1).max())  # per-tensor; a vector takes its max
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"KV cache scales must be positive and finite, got {value}")
        for i in which:
            self.kv_scale[i] = value

    def cache_slots(self, attn_metadata: Any) -> torch.Tensor | None:
        """The step's cache slots, where the kernel before attention may write this step's
        K/V into the cache itself (then `forward(q, None, None, ...)`); None where it may not:
        the backend writes them, or the first batch's k and v set the fp8 scales."""
        return None if self.calculate_kv_scales else self.impl.cache_slots(attn_metadata)

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor | None,  # [T, H_kv, D]; None: already in the cache (`cache_slots`)
        v: torch.Tensor | None,  # [T, H_kv, D]
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, H * D]
        if self.calculate_kv_scales:
            self.kv_scale.copy_(first_batch_scales(k, v))
            self.calculate_kv_scales = False
        return self.impl.forward(q, k, v, kv_cache, attn_metadata, self.kv_scale).flatten(1)
