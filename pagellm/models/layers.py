"""Building blocks shared by the decoder models: norms, rotary embedding, the gated MLP and
the `Attention` layer that owns one attention-backend instance; the linear layers
(`pagellm/models/linear.py`) and the vocabulary layers (`vocab_embedding.py`) are re-exported.

A model built from these shards over tensor-parallel ranks by construction: projections into
heads or MLP columns are column-parallel, projections out of them row-parallel, and the
`Attention` layer gets this rank's heads (`heads_per_rank`).

Models are built on the `meta` device; weights arrive through `load_weights` (see
`pagellm/models/weights.py`), which assigns real tensors in place of the meta parameters.

On CUDA, RMSNorm (+ residual add), rotary and SiLU-and-mul run as one Triton kernel each
(`pagellm/kernels/fused.py`); on the CPU they stay plain torch, the reference path.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.base import AttentionBackend
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
from pagellm.models.vocab_embedding import (  # noqa: F401  (re-exported for the models)
    ParallelLMHead,
    VocabParallelEmbedding,
    gather_logits,
)


@functools.cache
def _fused_module():
    try:
        from pagellm.kernels import fused
    except ImportError:  # no Triton: plain torch everywhere
        return None
    return fused


def _fused_ops(x: torch.Tensor):
    """The fused Triton ops for a CUDA tensor; None on the CPU (the torch reference path)."""
    return _fused_module() if x.is_cuda else None


class RMSNorm(nn.Module):
    """y = w * x / rms(x), computed in float32 and cast back (as HF does)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., size]
        fused = self._fused(x)
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps)[0]
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the residual stream first; return (normed, new residual)."""
        fused = self._fused(x)
        if fused is not None and x.dim() == 2:
            return fused.rms_norm(x, self.weight, self.eps, residual)
        residual = x + residual
        return self.forward(residual), residual

    def _fused(self, x: torch.Tensor):
        fused = _fused_ops(x)
        ok = fused is not None and self.weight.dtype == x.dtype and x.stride(-1) == 1
        return fused if ok and x.dim() in (2, 3) else None


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding with a precomputed cos/sin table per position.

    `rope_scaling` follows HF: None / "default", "linear" (factor) or "llama3" (factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings).
    """

    def __init__(
        self, head_dim: int, max_position: int, theta: float, rope_scaling: dict | None = None
    ) -> None:
        super().__init__()
        inv_freq = _scaled_inv_freq(default_inv_freq(head_dim, theta), rope_scaling)  # [D/2]
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)  # [max_position, D/2]
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_position, D]
        self.register_buffer("cos_sin", table, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # positions: [T] -> [T, 1, D] (cos | sin), broadcastable over heads
        return self.cos_sin.index_select(0, positions).to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos_sin: [T, 1, D] -> [T, H, D]
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
    """Qwen3's per-head RMSNorm of q and k, then rotary: one Triton kernel on CUDA."""
    fused = _fused_ops(qkv)
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


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (theta**exponents)


def _scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return llama3_inv_freq(inv_freq, scaling)
    raise NotImplementedError(f"rope scaling type {kind!r} is not supported")


def llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)  # 0 at the low edge, 1 at the high edge
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_len / high, inv_freq, out)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, 2 * I] (gate | up) -> [T, I]
        fused = _fused_ops(x)
        if fused is not None and x.dim() == 2 and x.stride(-1) == 1:
            return fused.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul; each rank holds
    1/tp of the intermediate columns (gate_up column-parallel, down row-parallel)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        shards = {"gate_proj": intermediate_size, "up_proj": intermediate_size}
        self.gate_up_proj = FusedLinear(hidden_size, shards, bias=bias)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Attention(nn.Module):
    """Paged attention through one instance of the model's attention backend."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        attn_backend_cls: type[AttentionBackend],
    ) -> None:
        super().__init__()
        self.impl = attn_backend_cls(num_heads, num_kv_heads, head_dim, head_dim**-0.5)

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, H * D]
        return self.impl.forward(q, k, v, kv_cache, attn_metadata).flatten(1)
