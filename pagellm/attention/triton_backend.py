"""The GPU attention backend: Triton kernels over the paged KV cache.

`forward` writes the step's K/V with `reshape_and_cache`, then runs `paged_attention`.
The host-side plan (which requests are decode tiles, the prefill tile -> request map, the
split-KV count) depends on the head layout, which a classmethod `build_metadata` cannot see;
so the metadata builds it on the first layer's call and every later layer reuses it.
A sliding-window layer gets a plan of its own (the window bounds its keys: split count, tile
order), never dropped for short sequences: a CUDA graph replays it at any length.
Importing this module needs Triton (ImportError otherwise, which the selector catches) but
no CUDA device.

CUDA graphs: a captured decode step replays the plan of the capture, including its split-KV
count (any count is correct for any lengths, only speed differs). Capture with the
`seq_lens` the graph should be fast for: the split heuristic looks at the longest context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagellm.attention.base import AttentionBackend, CommonAttentionMetadata
from pagellm.kernels.attention_plan import AttentionPlan, order_by_length, plan_attention
from pagellm.kernels.paged_attention import paged_attention
from pagellm.kernels.reshape_and_cache import reshape_and_cache


@dataclass
class TritonAttentionMetadata:
    """One step's metadata; `plan()` is computed once per head layout and sliding window and
    cached here."""

    common: CommonAttentionMetadata
    _plans: dict[tuple, AttentionPlan] = field(default_factory=dict)

    def plan(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        element_size: int = 2,
        sliding_window: int | None = None,
        kv_element_size: int | None = None,
    ) -> AttentionPlan:
        key = (num_heads, num_kv_heads, head_dim, element_size, kv_element_size, sliding_window)
        if key not in self._plans:
            c = self.common
            plan = plan_attention(
                c.query_start_loc_cpu,
                c.seq_lens_cpu,
                num_heads,
                num_kv_heads,
                head_dim,
                c.query_start_loc.device,
                element_size=element_size,
                sliding_window=sliding_window,
                kv_element_size=kv_element_size,
            )
            plan.launches = [order_by_length(launch, c.seq_lens) for launch in plan.launches]
            self._plans[key] = plan
        return self._plans[key]


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(common)

    def cache_slots(self, metadata: TritonAttentionMetadata) -> torch.Tensor:
        return metadata.common.slot_mapping

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None: in the cache
        v: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None: in the cache
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: TritonAttentionMetadata,
        kv_scale: torch.Tensor | None = None,  # [2] k_scale, v_scale (fp8 caches)
        sinks: torch.Tensor | None = None,  # [num_heads] float32 (gpt-oss)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        common = metadata.common
        if k is not None:
            reshape_and_cache(k, v, kv_cache, common.slot_mapping, kv_scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.shape[0] > common.num_actual_tokens:
            out[common.num_actual_tokens :].zero_()  # padded rows: defined, never attended
        plan = metadata.plan(
            self.num_heads, self.num_kv_heads, self.head_dim, q.element_size(),
            self.sliding_window, kv_cache.element_size(),
        )  # fmt: skip
        return paged_attention(
            q,
            kv_cache,
            common.block_table,
            common.seq_lens,
            common.query_start_loc,
            self.scale,
            plan=plan,
            out=out,
            logits_soft_cap=self.logits_soft_cap,
            kv_scale=kv_scale,
            sinks=sinks,
        )
