"""Multi-head latent attention (MLA, DeepSeek V2 / V3) over its own paged cache.

A layer's cache is `[1, num_blocks, block_size, 1, R + P]`: one row a token, the
compressed latent c (kv_lora_rank R, after its RMSNorm) then the rotated shared key part
k_pe (qk_rope_head_dim P), the same for every head. Head h's key and value are
`k_h = [W_UK[h] c, k_pe]` and `v_h = W_UV[h] c`, where kv_b_proj's weight, viewed
`[H, dn + dv, R]`, stacks W_UK [H, dn, R] over W_UV [H, dv, R].

Two forms of the same attention, each as HF's up to float rounding:

- expanded (prefill chunks, query length > 1): the chunk's keys and values are built per
  head from its request's latent rows (this step's, or gathered with its cached context)
  and attended causally with SDPA;
- absorbed (decodes, query length 1): W_UK folds into the query, `q_lat = q_nope W_UK[h]`
  [H, R], so a score is `[q_lat, q_pe] . row` over the cached rows as they are; the output
  stays latent (`softmax @ c`, [H, R]) until W_UV turns it into [H, dv]. No per-head key or
  value is ever built for a decode: it reads R + P numbers a token, not H * (dn + dv + P).

On CUDA the decodes of a step go through the Triton kernel of `pagellm/kernels/mla_decode.py`
(a decode-only step with device tensors only: CUDA graphs replay it; a mixed step's decodes
by their rows and requests); elsewhere through torch, in the decode groups and prefill
chunks the torch backend plans (`TorchAttentionMetadata`), built once a step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.attention.torch_backend import (
    DecodeGroup,
    TorchAttentionBackend,
    TorchAttentionMetadata,
)


def latent_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """`[1, blocks, block_size, 1, R + P]` -> `[slots, R + P]` (a view)."""
    return kv_cache.view(-1, kv_cache.shape[-1])


def torch_work(metadata: Any) -> TorchAttentionMetadata:
    """The step's decode groups and prefill chunks: the torch backend's own metadata, or one
    built from another backend's `common` once a step (kept on that metadata)."""
    if isinstance(metadata, TorchAttentionMetadata):
        return metadata
    work = getattr(metadata, "mla_work", None)
    if work is None:
        work = TorchAttentionBackend.build_metadata(metadata.common)
        metadata.mla_work = work
    return work


def kernel_rows(work: TorchAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixed step's decodes for the kernel: their rows of the flat batch (int64) and their
    requests (int32), on the device, once a step (kept on `work`)."""
    cached = getattr(work, "mla_rows", None)
    if cached is None:
        reqs = work.decode_reqs
        device = work.common.block_table.device
        rows = work.common.query_start_loc_cpu[reqs].astype(np.int64)
        cached = (
            torch.from_numpy(rows).to(device),
            torch.from_numpy(reqs.astype(np.int32)).to(device),
        )
        work.mla_rows = cached
    return cached


def _decode_kernel(q: torch.Tensor):
    """The Triton decode module for CUDA queries; None elsewhere (or without Triton)."""
    if not q.is_cuda:
        return None
    try:
        from pagellm.kernels import mla_decode
    except ImportError:  # no Triton
        return None
    return mla_decode


class MLAAttention:
    """One layer's latent attention: the cache write and both forms (see the module doc).
    Not an `AttentionBackend`: it takes latent rows, not per-head K and V."""

    def __init__(
        self, num_heads: int, nope_dim: int, kv_lora_rank: int, rope_dim: int, scale: float
    ) -> None:
        self.num_heads = num_heads  # this rank's
        self.nope_dim = nope_dim  # dn: a head's unrotated q / k dims
        self.rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.scale = scale

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, dn]
        q_pe: torch.Tensor,  # [T, H, P] rotated
        latent: torch.Tensor,  # [T, R + P]: normed c, then rotated k_pe
        w_kv: torch.Tensor,  # [H, dn + dv, R]: kv_b_proj's weight by head
        kv_cache: torch.Tensor,  # [1, blocks, block_size, 1, R + P]
        metadata: Any,  # the step's attention metadata (any backend's; `.common`)
    ) -> torch.Tensor:  # [T, H, dv]
        common = getattr(metadata, "common", metadata)
        n = common.num_actual_tokens
        cache = latent_cache(kv_cache)
        slots = common.slot_mapping[:n]
        if slots.is_cuda:  # CUDA-graph padding rows (slot -1) write into the null block
            slots = slots.clamp(min=0)
        cache.index_copy_(0, slots, latent[:n].to(cache.dtype))
        dv = w_kv.shape[1] - self.nope_dim
        out = q_nope.new_zeros(q_nope.shape[0], self.num_heads, dv)
        kernel = _decode_kernel(q_nope)
        if kernel is not None and common.max_query_len == 1:  # decodes only: all on the device
            out[:n] = self._kernel_decodes(q_nope[:n], q_pe[:n], w_kv, kv_cache, common, kernel)
            return out
        work = torch_work(metadata)
        for chunk in work.prefills:
            rows = slice(chunk.start, chunk.end)
            keys = latent[rows] if chunk.slots is None else cache.index_select(0, chunk.slots)
            out[rows] = self._expanded(q_nope[rows], q_pe[rows], keys, w_kv, chunk.mask)
        if kernel is not None and len(work.decode_reqs):  # a mixed step's decodes
            rows, reqs = kernel_rows(work)
            q_rows = (q_nope.index_select(0, rows), q_pe.index_select(0, rows))
            decoded = self._kernel_decodes(*q_rows, w_kv, kv_cache, common, kernel, reqs)
            out.index_copy_(0, rows, decoded)
            return out
        for group in work.decodes:
            q_lat = self._absorb(q_nope.index_select(0, group.rows), w_kv)
            o_lat = self._decode_group(q_lat, q_pe.index_select(0, group.rows), cache, group)
            out.index_copy_(0, group.rows, self._unabsorb(o_lat, w_kv))
        return out

    def _absorb(self, q_nope: torch.Tensor, w_kv: torch.Tensor) -> torch.Tensor:
        # q_nope [n, H, dn] x W_UK [H, dn, R] -> [n, H, R]
        return torch.bmm(q_nope.transpose(0, 1), w_kv[:, : self.nope_dim]).transpose(0, 1)

    def _unabsorb(self, o_lat: torch.Tensor, w_kv: torch.Tensor) -> torch.Tensor:
        # o_lat [n, H, R] x W_UV^T [H, R, dv] -> [n, H, dv]
        w_uv = w_kv[:, self.nope_dim :]
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _decode_group(
        self, q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, group: DecodeGroup
    ) -> torch.Tensor:  # [n, H, R]
        n, length = group.slots.shape
        rows = cache.index_select(0, group.slots.view(-1)).to(q_lat.dtype)
        rows = rows.view(n, 1, length, -1)  # [n, 1, L, R + P]: one "KV head"
        q = torch.cat([q_lat, q_pe], dim=-1)[:, None]  # [n, 1, H, R + P]: heads as query rows
        values = rows[..., : self.rank]
        out = F.scaled_dot_product_attention(q, rows, values, group.bias(q.dtype), scale=self.scale)
        return out[:, 0]

    def _kernel_decodes(
        self, q_nope, q_pe, w_kv, kv_cache, common, kernel, reqs=None
    ) -> torch.Tensor:  # [n, H, dv]
        """Decodes on CUDA through the Triton kernel over the latent cache: row i the decode
        of request reqs[i] (None: of request i, a decode-only step; CUDA-graph padding rows
        compute values nobody reads)."""
        q = torch.cat([self._absorb(q_nope, w_kv), q_pe], dim=-1)  # [n, H, R + P]
        o_lat = kernel.mla_decode(
            q, kv_cache, common.block_table, common.seq_lens, self.rank, self.scale,
            max_seq_len=common.max_seq_len, reqs=reqs,
        )  # fmt: skip
        return self._unabsorb(o_lat, w_kv)

    def _expanded(
        self,
        q_nope: torch.Tensor,  # [ql, H, dn]
        q_pe: torch.Tensor,  # [ql, H, P]
        rows: torch.Tensor,  # [L, R + P] the chunk's keys' latent rows
        w_kv: torch.Tensor,  # [H, dn + dv, R]
        mask: torch.Tensor | None,  # [ql, L] bool; None: plain causal (L == ql)
    ) -> torch.Tensor:  # [ql, H, dv]
        dn, length = self.nope_dim, rows.shape[0]
        rows = rows.to(q_nope.dtype)
        kv = torch.matmul(rows[:, : self.rank], w_kv.flatten(0, 1).t())  # [L, H * (dn + dv)]
        kv = kv.view(length, self.num_heads, -1).transpose(0, 1)  # [H, L, dn + dv]
        k_pe = rows[:, self.rank :].expand(self.num_heads, length, self.rope_dim)
        keys = torch.cat([kv[..., :dn], k_pe], dim=-1)  # [H, L, dn + P]
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, ql, dn + P]
        out = F.scaled_dot_product_attention(
            q[None], keys[None], kv[None, ..., dn:], mask, is_causal=mask is None,
            scale=self.scale,
        )  # fmt: skip
        return out[0].transpose(0, 1)
