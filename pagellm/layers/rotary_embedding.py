"""Rotary embedding: `RotaryEmbedding` (the cos/sin table of `rope.py` by position),
`apply_rotary` (partial rotary included) and Qwen3's q/k RMSNorm + rotary (`qk_norm_rotary`)."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.layers import fused_ops
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.rope import cos_sin_table


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding with a precomputed cos/sin table per position.

    `rope_scaling` follows HF: None / "default", "linear", "llama3", "yarn", "dynamic" or
    "longrope" with their parameters (see `pagellm/layers/rope.py`); `head_dim` is the number
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
    fused = fused_ops.ops_for(x)
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
    fused = fused_ops.ops_for(qkv) if qkv.is_cuda else None
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
