"""PyTorch attention over the paged KV cache: the CPU path and the reference for GPU kernels.

`build_metadata` runs once per step and turns the flat batch into two kinds of work:

- decodes (query length 1), wherever they sit in the flat batch, sorted by length and cut into
  groups of similar lengths (`DecodeGroup`, at most about DECODE_GROUP_TOKENS padded keys
  each): a group gathers its keys through `slots [n, max_seq_len]`, flat cache slots where
  padding repeats the request's last slot (so a gather never reads a slot the request does
  not own), and runs one `scaled_dot_product_attention` call with a padding mask. Sorting
  cuts the padding; small groups keep the gathered keys in cache while SDPA reads them;
- prefill chunks (query length > 1), one attention call each: a chunk without context attends
  causally to this step's own keys; a chunk after a cached context gathers its request's
  keys from the cache and uses a causal mask shifted right by the context length.

Keys and values are never repeated for grouped-query attention: a decode views the query heads
of one KV head as that head's query rows, a prefill uses SDPA's `enable_gqa`. Gathers use
`index_select` on the flat `[num_slots, H_kv, D]` cache, 2-3x faster on CPU than fancy indexing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.attention.base import AttentionBackend, CommonAttentionMetadata

# padded keys (rows x longest length) per decode group; 2048 x 3 KV heads x 64 dims x fp32 is
# 1.5 MiB of K and of V, which stay in cache between the gather and SDPA
DECODE_GROUP_TOKENS = 2048


@dataclass
class DecodeGroup:
    """Query-length-1 requests of similar lengths, attended together."""

    rows: torch.Tensor  # [n] int64: their rows in the flat batch
    slots: torch.Tensor  # [n, max_seq_len] int64 flat cache slots
    mask: torch.Tensor  # [n, 1, 1, max_seq_len] bool, True where a key is attended
    _bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """`mask` as SDPA's additive form (0 or -inf), made once per step for all layers:
        given the bool mask, SDPA converts it on every call."""
        if dtype not in self._bias:
            bias = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self._bias[dtype] = bias.masked_fill_(~self.mask, float("-inf"))
        return self._bias[dtype]


@dataclass
class PrefillChunk:
    """One request with query length > 1."""

    start: int  # its query rows in the flat batch: start .. end
    end: int
    slots: torch.Tensor | None  # [seq_len] int64; None when the chunk has no cached context
    mask: torch.Tensor | None  # [query_len, seq_len] bool; None: plain causal


@dataclass
class TorchAttentionMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, where this step's K/V are written
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        qsl = common.query_start_loc_cpu
        query_lens = np.diff(qsl)
        context_lens = common.seq_lens_cpu - query_lens
        decode_reqs = np.flatnonzero(query_lens == 1)
        prefill_reqs = np.flatnonzero(query_lens > 1)
        decodes = _build_decode_groups(common, decode_reqs) if len(decode_reqs) else []
        prefills = [_build_prefill(common, int(r), int(context_lens[r])) for r in prefill_reqs]
        return TorchAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            decodes=decodes,
            prefills=prefills,
        )

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        n = metadata.num_actual_tokens
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)  # [slots, H_kv, D]
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
        key_cache.index_copy_(0, metadata.slot_mapping, k[:n])
        value_cache.index_copy_(0, metadata.slot_mapping, v[:n])
        out = torch.empty_like(q)
        out[n:] = 0  # padding rows beyond the flat batch
        for group in metadata.decodes:
            out.index_copy_(0, group.rows, self._decode(q, key_cache, value_cache, group))
        for chunk in metadata.prefills:
            out[chunk.start : chunk.end] = self._prefill(q, k, v, key_cache, value_cache, chunk)
        return out

    def _decode(self, q, key_cache, value_cache, group: DecodeGroup) -> torch.Tensor:
        # the query heads sharing a KV head act as that head's query rows: [n, H_kv, group, D]
        n = group.slots.shape[0]
        q_d = q.index_select(0, group.rows).view(n, self.num_kv_heads, -1, self.head_dim)
        shape = (*group.slots.shape, self.num_kv_heads, self.head_dim)
        flat = group.slots.view(-1)
        keys = key_cache.index_select(0, flat).view(shape).transpose(1, 2)  # [n, H_kv, L, D]
        values = value_cache.index_select(0, flat).view(shape).transpose(1, 2)
        bias = group.bias(q.dtype)
        out = F.scaled_dot_product_attention(q_d, keys, values, bias, scale=self.scale)
        return out.reshape(n, self.num_heads, self.head_dim)

    def _prefill(self, q, k, v, key_cache, value_cache, chunk: PrefillChunk) -> torch.Tensor:
        rows = slice(chunk.start, chunk.end)
        if chunk.slots is None:  # no cached context: this step's keys are the whole sequence
            keys, values = k[rows], v[rows]  # [seq_len, H_kv, D]
        else:
            keys = key_cache.index_select(0, chunk.slots)
            values = value_cache.index_select(0, chunk.slots)
        # 4-D inputs: with 3-D ones and enable_gqa, CPU SDPA falls back to its math kernel
        out = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None],  # [1, H, query_len, D]
            keys.transpose(0, 1)[None],  # [1, H_kv, seq_len, D]
            values.transpose(0, 1)[None],
            chunk.mask,
            is_causal=chunk.mask is None,
            scale=self.scale,
            enable_gqa=True,
        )[0]
        return out.transpose(0, 1)  # [query_len, H, D]


def _build_decode_groups(common: CommonAttentionMetadata, reqs: np.ndarray) -> list[DecodeGroup]:
    """Decode requests, longest first, in groups of at most ~DECODE_GROUP_TOKENS padded keys."""
    device = common.block_table.device
    all_lens = common.seq_lens_cpu[reqs]
    order = np.argsort(-all_lens, kind="stable")
    reqs, all_lens = reqs[order], all_lens[order]
    groups, i = [], 0
    while i < len(reqs):
        max_len = int(all_lens[i])  # the group's longest: the first, lengths go down
        n = max(1, DECODE_GROUP_TOKENS // max_len)
        g_reqs, seq_lens = reqs[i : i + n], all_lens[i : i + n]
        i += n
        # positions clamped to each request's last token: padding re-reads a slot it owns
        pos = np.minimum(np.arange(max_len)[None, :], seq_lens[:, None] - 1)  # [n, max_len]
        g_reqs_t, pos_t = torch.from_numpy(g_reqs).to(device), torch.from_numpy(pos).to(device)
        slots = _slots(common, g_reqs_t, pos_t)
        mask = torch.from_numpy(np.arange(max_len)[None, :] < seq_lens[:, None]).to(device)
        rows = torch.from_numpy(common.query_start_loc_cpu[g_reqs].astype(np.int64)).to(device)
        groups.append(DecodeGroup(rows=rows, slots=slots, mask=mask[:, None, None, :]))
    return groups


def _build_prefill(common: CommonAttentionMetadata, req: int, context_len: int) -> PrefillChunk:
    start, end = (int(x) for x in common.query_start_loc_cpu[req : req + 2])
    if context_len == 0:
        return PrefillChunk(start, end, slots=None, mask=None)
    device = common.block_table.device
    seq_len = context_len + end - start
    pos = torch.arange(seq_len, device=device)
    slots = _slots(common, torch.tensor([req], device=device), pos[None, :])[0]
    # query i (at position context_len + i) sees keys 0 .. context_len + i
    q_pos = torch.arange(context_len, seq_len, device=device)
    mask = pos[None, :] <= q_pos[:, None]  # [query_len, seq_len]
    return PrefillChunk(start, end, slots=slots, mask=mask)


def _slots(common: CommonAttentionMetadata, reqs: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Flat cache slots of positions `pos [n, L]` of requests `reqs [n]` -> [n, L] int64."""
    bs = common.block_size
    blocks = torch.gather(common.block_table[reqs].long(), 1, pos // bs)  # [n, L]
    return blocks * bs + pos % bs
