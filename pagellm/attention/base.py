"""The attention backend interface and the per-step metadata every backend starts from.

The KV cache of one layer is one tensor, `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0: keys, 1: values). Token t of request r lives in slot
`block_table[r, pos // block_size] * block_size + pos % block_size`.

One step's batch is flat: the query tokens of all scheduled requests, request after request.

    request r:  |<------------- seq_lens[r] ------------->|
                |<--- context (already in the cache) --->|<-- query -->|
                                                          query_start_loc[r] .. query_start_loc[r+1]

A decode is a request whose query length is 1; a prefill chunk attends causally to its
own tokens and to the whole context before it.

Per layer (each layer owns its backend instance): `scale` multiplies q.k; `sliding_window` W
lets the query at position p see only keys p - W < k <= p (HF's `sliding_window_overlay`);
`logits_soft_cap` c turns a score s into c * tanh(s / c) before the softmax (Gemma 2).
Attention sinks (gpt-oss, passed to `forward`): a learned logit per query head that joins
each softmax's denominator, exp(sink) beside the keys' exponentials, with no value of its own.

The cache may be float8 (`kv_cache_dtype="fp8"`): K/V are stored divided by the layer's
`kv_scale = [k_scale, v_scale]` and read back times them (`pagellm.kv_cache_dtype`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class CommonAttentionMetadata:
    """What the model runner builds once per step, before any backend-specific work."""

    num_reqs: int
    block_size: int
    num_actual_tokens: int  # tokens in the flat batch (inputs may be padded beyond this)
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the device
    seq_lens: torch.Tensor  # [num_reqs] int32, context + query, on the device
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, on the device
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, on the device
    query_start_loc_cpu: np.ndarray  # [num_reqs + 1] int32
    seq_lens_cpu: np.ndarray  # [num_reqs] int32


class AttentionBackend(ABC):
    """One attention implementation. Build metadata once per step, then run every layer.

    Invariants: `forward` first writes this step's K/V into the cache at `slot_mapping`
    (unless a projection has written them already: `cache_slots`, k and v None), then
    attends each query token to all tokens of its request up to and including itself
    (only the last `sliding_window` of them, when set). Keys outside a query's window are
    never read: their blocks may already belong to another request.
    """

    name: str = "base"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, parts: int = 2
    ) -> tuple[int, ...]:
        """`parts` 1: latent attention's one row a token (`pagellm/attention/mla.py`)."""
        return (parts, num_blocks, block_size, num_kv_heads, head_dim)

    @classmethod
    @abstractmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> Any:
        """Per-step work shared by all layers (index tensors, masks, splits); called once a step."""

    def cache_slots(self, metadata: Any) -> torch.Tensor | None:
        """The step's cache slot of each token, for a kernel before attention that writes the
        step's K/V into the cache itself (the fp8 q | k | v GEMV at batch 1), after which
        `forward` takes k and v None; None: this backend writes them in `forward`."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None: in the cache
        v: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None: in the cache
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: Any,  # what build_metadata returned
        kv_scale: torch.Tensor | None = None,  # [2] float32 k_scale, v_scale (fp8 caches)
        sinks: torch.Tensor | None = None,  # [num_heads] float32 sink logits (gpt-oss)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k/v into the cache (quantized when it is fp8), then attend."""
