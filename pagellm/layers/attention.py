"""`Attention`: the layer that owns one attention-backend instance (scale, sliding window,
logit soft-cap), an fp8 KV cache's scales (`pagellm/kv_cache_dtype.py`) and gpt-oss's
attention sinks."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagellm.attention.base import AttentionBackend
from pagellm.distributed.parallel_state import get_tp_group
from pagellm.kv_cache_dtype import first_batch_scales
from pagellm.layers.weights import TensorSlice


class Attention(nn.Module):
    """Paged attention through one instance of the model's attention backend.

    `scale` multiplies q.k (default head_dim ** -0.5); `sliding_window` W: a query sees only
    the keys of its last W positions, itself included (HF's `sliding_window`);
    `logits_soft_cap` c: scores become c * tanh(score / c) before the softmax; `sinks`:
    a learned logit per query head (parameter `sinks`, float32, this rank's heads) in each
    softmax's denominator (gpt-oss).
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
        sinks: bool = False,
    ) -> None:
        super().__init__()
        self.sinks = None
        if sinks:  # one rank's heads of the checkpoint's [num_heads * tp]
            empty = torch.empty(num_heads, dtype=torch.float32)
            self.sinks = nn.Parameter(empty, requires_grad=False)
        self.num_heads = num_heads
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

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The sinks' checkpoint shape: every rank's heads."""
        return (self.num_heads * get_tp_group().size,)

    def checkpoint_slice(self, name: str) -> TensorSlice:
        """This rank's heads of the checkpoint's sinks."""
        return TensorSlice(0, get_tp_group().rank * self.num_heads, self.num_heads)

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
        if self.sinks is None:  # backends without sinks keep their signature
            return self.impl.forward(q, k, v, kv_cache, attn_metadata, self.kv_scale).flatten(1)
        out = self.impl.forward(q, k, v, kv_cache, attn_metadata, self.kv_scale, sinks=self.sinks)
        return out.flatten(1)
