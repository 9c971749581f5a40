"""PyTorch attention over the paged KV cache: the CPU path and the reference for GPU kernels.

`build_metadata` runs once per step; the work it describes is built on first use, once per
step, in one of two forms:

- on the CPU, every query row of the step, decodes and prefill chunks alike, most keys first,
  to one call of a C++ kernel per layer that reads the paged cache in place (`cpu_decode`:
  no copy of the keys; a prefill row attends causally to its request's keys, this step's
  written first: `kernel_rows`). Elsewhere, or without a compiler, two kinds of work:
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

A sliding-window layer uses the same work built for its window (`metadata.windowed(W)`, once
per step and window): a decode gathers only its last W keys, a prefill chunk the keys from
its first query's window start on, with a banded causal mask. Nothing outside a window is
read. With a logit soft-cap or attention sinks (gpt-oss) the scores are computed explicitly
(SDPA can neither cap them nor add a sink to its denominator).

An fp8 cache is written quantized (through a uint8 view: the CPU has no fp8 `index_copy_`)
and each group's gathered keys are converted to the query's dtype; k_scale goes into SDPA's
scale and v_scale multiplies the output. A prefill chunk without context attends to this
step's keys as the cache holds them, so a prefix-cache hit and a recompute see the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.attention import cpu_decode
from pagellm.attention.base import AttentionBackend, CommonAttentionMetadata
from pagellm.kv_cache_dtype import is_fp8, quantize

# padded keys (rows x longest length) per decode group; 2048 x 3 KV heads x 64 dims x fp32 is
# 1.5 MiB of K and of V, which stay in cache between the gather and SDPA
DECODE_GROUP_TOKENS = 2048


@dataclass
class DecodeGroup:
    """Query-length-1 requests of similar lengths, attended together."""

    rows: torch.Tensor  # [n] int64: their rows in the flat batch
    slots: torch.Tensor  # [n, max_keys] int64 flat cache slots of the keys each row attends
    mask: torch.Tensor  # [n, 1, 1, max_keys] bool, True where a key is attended
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
    # [num_keys] int64 slots of its keys (from its first query's window start, else 0);
    # None when the chunk has no cached context: its keys are this step's
    slots: torch.Tensor | None
    mask: torch.Tensor | None  # [query_len, num_keys] bool; None: plain causal


@dataclass
class KernelRows:
    """Every query row of the step, most keys first: the in-place kernel's work."""

    rows: torch.Tensor  # [n] int64 rows of the flat batch
    reqs: torch.Tensor  # [n] int64 their requests
    lens: torch.Tensor  # [n] int32 the keys each attends (its position + 1)


@dataclass
class TorchAttentionMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, where this step's K/V are written
    common: CommonAttentionMetadata
    decode_reqs: np.ndarray  # [n] requests with query length 1
    prefill_reqs: np.ndarray  # [m] requests with query length > 1
    window: int | None = None  # the window this work was built for
    _windowed: dict[int, TorchAttentionMetadata] = field(default_factory=dict, repr=False)
    _decodes: list[DecodeGroup] | None = field(default=None, repr=False)
    _prefills: list[PrefillChunk] | None = field(default=None, repr=False)
    _kernel_rows: KernelRows | None = field(default=None, repr=False)

    @property
    def decodes(self) -> list[DecodeGroup]:
        """The gather path's decode groups, built on first use."""
        if self._decodes is None:
            reqs = self.decode_reqs
            self._decodes = (
                _build_decode_groups(self.common, reqs, self.window) if len(reqs) else []
            )
        return self._decodes

    @property
    def prefills(self) -> list[PrefillChunk]:
        """The gather path's prefill chunks, built on first use."""
        if self._prefills is None:
            common = self.common
            context_lens = common.seq_lens_cpu - np.diff(common.query_start_loc_cpu)
            self._prefills = [
                _build_prefill(common, int(r), int(context_lens[r]), self.window)
                for r in self.prefill_reqs
            ]
        return self._prefills

    @property
    def kernel_rows(self) -> KernelRows:
        """The in-place kernel's rows, most keys first, built on first use."""
        if self._kernel_rows is None:
            common = self.common
            n = common.num_actual_tokens
            starts = common.query_start_loc_cpu
            query_lens = np.diff(starts)
            reqs = np.repeat(np.arange(len(query_lens)), query_lens)  # [n] request of each row
            # a row's position + 1: its request's seq_len minus the rows after it in the request
            lens = common.seq_lens_cpu[reqs] - (starts[reqs + 1] - 1 - np.arange(n))
            order = np.argsort(-lens, kind="stable")
            device = common.block_table.device
            self._kernel_rows = KernelRows(
                torch.from_numpy(order.astype(np.int64)).to(device),
                torch.from_numpy(reqs[order].astype(np.int64)).to(device),
                torch.from_numpy(lens[order].astype(np.int32)).to(device),
            )
        return self._kernel_rows

    def windowed(self, window: int | None) -> TorchAttentionMetadata:
        """This step's work for layers whose queries see only their last `window` keys."""
        if window is None or window >= self.common.max_seq_len:
            return self  # no query has a key outside its window
        if window not in self._windowed:
            self._windowed[window] = _build_metadata(self.common, window)
        return self._windowed[window]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    # False: CPU attention takes the gather + SDPA path too (A/B benchmarks). Every cache kind
    # reads in place: float32, fp8 and bf16 (workload W, bf16, decodes only in place: 1.09x
    # end to end against gathering for SDPA, interleaved in one run; docs/notes.md, CPU attention)
    in_place = True

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        return _build_metadata(common, None)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: TorchAttentionMetadata,
        kv_scale: torch.Tensor | None = None,  # [2] k_scale, v_scale (fp8 caches)
        sinks: torch.Tensor | None = None,  # [num_heads] float32 (gpt-oss)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        n = metadata.num_actual_tokens
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)  # [slots, H_kv, D]
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
        k, v, k_scale, v_scale = write_kv(
            key_cache, value_cache, k[:n], v[:n], metadata.slot_mapping, kv_scale
        )
        scale = self.scale * k_scale  # fp8: q . stored * k_scale is q . k
        out = torch.empty_like(q)
        out[n:] = 0  # padding rows beyond the flat batch
        if self._in_place(q):  # every row through the kernel, windows included
            self._attend_in_place(q, kv_cache, metadata, scale, out, sinks)
        else:
            work = metadata.windowed(self.sliding_window)
            for group in work.decodes:
                decoded = self._decode(q, key_cache, value_cache, group, scale, sinks)
                out.index_copy_(0, group.rows, decoded)
            for chunk in work.prefills:
                attended = self._prefill(q, k, v, key_cache, value_cache, chunk, scale, sinks)
                out[chunk.start : chunk.end] = attended
        if v_scale != 1.0:
            out[:n] *= v_scale
        return out

    def _in_place(self, q: torch.Tensor) -> bool:
        supported = q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
        return supported and self.in_place and cpu_decode.kernel() is not None

    def _attend_in_place(self, q, kv_cache, metadata, scale, out, sinks) -> None:
        rows = metadata.kernel_rows
        cpu_decode.paged_attention(
            out, q, kv_cache[0], kv_cache[1], metadata.common.block_table, rows.rows,
            rows.reqs, rows.lens, scale, window=self.sliding_window,
            soft_cap=self.logits_soft_cap, sinks=sinks,
        )  # fmt: skip

    def _decode(self, q, key_cache, value_cache, group: DecodeGroup, scale, sinks) -> torch.Tensor:
        # the query heads sharing a KV head act as that head's query rows: [n, H_kv, group, D]
        n = group.slots.shape[0]
        q_d = q.index_select(0, group.rows).view(n, self.num_kv_heads, -1, self.head_dim)
        shape = (*group.slots.shape, self.num_kv_heads, self.head_dim)
        flat = group.slots.view(-1)
        keys = _gather(key_cache, flat, q.dtype).view(shape).transpose(1, 2)  # [n, H_kv, L, D]
        values = _gather(value_cache, flat, q.dtype).view(shape).transpose(1, 2)
        bias = group.bias(q.dtype)
        if self.logits_soft_cap is not None or sinks is not None:
            row_sinks = None if sinks is None else sinks.view(1, self.num_kv_heads, -1, 1)
            cap = self.logits_soft_cap
            out = _explicit_attention(q_d, keys, values, bias, scale, cap, row_sinks)
        else:
            out = F.scaled_dot_product_attention(q_d, keys, values, bias, scale=scale)
        return out.reshape(n, self.num_heads, self.head_dim)

    def _prefill(self, q, k, v, key_cache, value_cache, chunk: PrefillChunk, scale, sinks):
        # -> [query_len, H, D]
        rows = slice(chunk.start, chunk.end)
        if chunk.slots is None:  # no cached context: this step's keys are the whole sequence
            keys, values = k[rows], v[rows]  # [seq_len, H_kv, D]
        else:
            keys = _gather(key_cache, chunk.slots, q.dtype)
            values = _gather(value_cache, chunk.slots, q.dtype)
        q_4d = q[rows].transpose(0, 1)[None]  # [1, H, query_len, D]
        keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # [1, H_kv, L, D]
        if self.logits_soft_cap is not None or sinks is not None:
            out = self._explicit_prefill(q_4d, keys, values, chunk.mask, scale, sinks)
        else:
            # 4-D inputs: with 3-D ones and enable_gqa, CPU SDPA falls back to its math kernel
            out = F.scaled_dot_product_attention(
                q_4d, keys, values, chunk.mask, is_causal=chunk.mask is None,
                scale=scale, enable_gqa=True,
            )  # fmt: skip
        return out[0].transpose(0, 1)  # [query_len, H, D]

    def _explicit_prefill(self, q, keys, values, mask, scale, sinks) -> torch.Tensor:
        # q: [1, H, ql, D] -> the query heads of one KV head as its rows: [1, H_kv, g * ql, D]
        ql, seq_len = q.shape[2], keys.shape[2]
        if mask is None:  # no context: plain causal
            mask = torch.ones(ql, seq_len, dtype=torch.bool, device=q.device).tril()
        group = self.num_heads // self.num_kv_heads
        q_g = q.reshape(1, self.num_kv_heads, group * ql, self.head_dim)
        cap = self.logits_soft_cap
        row_sinks = None  # [1, H_kv, g * ql, 1]: each query row's head's sink
        if sinks is not None:
            row_sinks = sinks.view(self.num_kv_heads, group).repeat_interleave(ql, dim=1)
            row_sinks = row_sinks[None, :, :, None]
        out = _explicit_attention(q_g, keys, values, mask.repeat(group, 1), scale, cap, row_sinks)
        return out.view(1, self.num_heads, ql, self.head_dim)


def write_kv(
    key_cache: torch.Tensor,  # [num_slots, H_kv, D]
    value_cache: torch.Tensor,  # [num_slots, H_kv, D]
    k: torch.Tensor,  # [n, H_kv, D]
    v: torch.Tensor,  # [n, H_kv, D]
    slots: torch.Tensor,  # [n] int64
    kv_scale: torch.Tensor | None,  # [2] k_scale, v_scale; None: 1.0
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Write this step's K/V at `slots`; return them as attention reads them (fp8: the stored
    values in k's dtype) with (k_scale, v_scale)."""
    if not is_fp8(key_cache.dtype):
        key_cache.index_copy_(0, slots, k)
        value_cache.index_copy_(0, slots, v)
        return k, v, 1.0, 1.0
    k_scale, v_scale = (1.0, 1.0) if kv_scale is None else kv_scale.tolist()
    k8 = quantize(k, k_scale, key_cache.dtype)
    v8 = quantize(v, v_scale, value_cache.dtype)
    key_cache.view(torch.uint8).index_copy_(0, slots, k8.view(torch.uint8))
    value_cache.view(torch.uint8).index_copy_(0, slots, v8.view(torch.uint8))
    return k8.to(k.dtype), v8.to(v.dtype), k_scale, v_scale


def _gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `slots` of a `[num_slots, H_kv, D]` cache, in `dtype` (fp8 rows converted)."""
    return cache.index_select(0, slots).to(dtype)


def _explicit_attention(
    q: torch.Tensor,  # [B, H_kv, M, D]
    keys: torch.Tensor,  # [B, H_kv, L, D]
    values: torch.Tensor,  # [B, H_kv, L, D]
    mask: torch.Tensor,  # bool (True: attended) or additive, broadcastable to [B, H_kv, M, L]
    scale: float,
    cap: float | None,
    sinks: torch.Tensor | None = None,  # float32, broadcastable to [B, H_kv, M, 1]
) -> torch.Tensor:  # [B, H_kv, M, D]
    """softmax(cap * tanh(scale * q.k / cap) + mask) @ v, as HF's eager Gemma 2 attention;
    with `sinks`, each row's sink logit joins the softmax's denominator only (gpt-oss:
    HF's eager attention appends it as a last score and drops its weight)."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    if sinks is None:
        return torch.matmul(scores.softmax(-1), values)
    scores = scores.float()
    top = torch.maximum(scores.amax(-1, keepdim=True), sinks)
    weights = torch.exp(scores - top)
    weights = weights / (weights.sum(-1, keepdim=True) + torch.exp(sinks - top))
    return torch.matmul(weights.to(values.dtype), values)


def _build_metadata(common: CommonAttentionMetadata, window: int | None) -> TorchAttentionMetadata:
    query_lens = np.diff(common.query_start_loc_cpu)
    return TorchAttentionMetadata(
        num_actual_tokens=common.num_actual_tokens,
        slot_mapping=common.slot_mapping[: common.num_actual_tokens],
        common=common,
        decode_reqs=np.flatnonzero(query_lens == 1),
        prefill_reqs=np.flatnonzero(query_lens > 1),
        window=window,
    )


def _build_decode_groups(
    common: CommonAttentionMetadata, reqs: np.ndarray, window: int | None
) -> list[DecodeGroup]:
    """Decode requests, most keys first, in groups of at most ~DECODE_GROUP_TOKENS padded keys;
    with a window, a request's keys are its last `window` tokens."""
    device = common.block_table.device
    seq_lens = common.seq_lens_cpu[reqs]
    all_lens = seq_lens if window is None else np.minimum(seq_lens, window)  # keys attended
    order = np.argsort(-all_lens, kind="stable")
    reqs, all_lens, all_firsts = reqs[order], all_lens[order], (seq_lens - all_lens)[order]
    groups, i = [], 0
    while i < len(reqs):
        max_len = int(all_lens[i])  # the group's longest: the first, lengths go down
        n = max(1, DECODE_GROUP_TOKENS // max_len)
        g_reqs, lens, firsts = reqs[i : i + n], all_lens[i : i + n], all_firsts[i : i + n]
        i += n
        # positions clamped to each request's last token: padding re-reads a slot it owns
        pos = firsts[:, None] + np.minimum(np.arange(max_len)[None, :], lens[:, None] - 1)
        g_reqs_t, pos_t = torch.from_numpy(g_reqs).to(device), torch.from_numpy(pos).to(device)
        slots = _slots(common, g_reqs_t, pos_t)  # [n, max_len]
        mask = torch.from_numpy(np.arange(max_len)[None, :] < lens[:, None]).to(device)
        rows = torch.from_numpy(common.query_start_loc_cpu[g_reqs].astype(np.int64)).to(device)
        groups.append(DecodeGroup(rows=rows, slots=slots, mask=mask[:, None, None, :]))
    return groups


def _build_prefill(
    common: CommonAttentionMetadata, req: int, context_len: int, window: int | None
) -> PrefillChunk:
    start, end = (int(x) for x in common.query_start_loc_cpu[req : req + 2])
    seq_len = context_len + end - start
    window = None if window is None or window >= seq_len else window
    if context_len == 0 and window is None:
        return PrefillChunk(start, end, slots=None, mask=None)
    device = common.block_table.device
    # keys from the first query's window start: query i (at position context_len + i) sees
    # keys context_len + i - window < k <= context_len + i
    first = 0 if window is None else max(0, context_len - window + 1)
    pos = torch.arange(first, seq_len, device=device)
    q_pos = torch.arange(context_len, seq_len, device=device)[:, None]
    mask = pos[None, :] <= q_pos  # [query_len, seq_len - first]
    if window is not None:
        mask &= pos[None, :] > q_pos - window
    if context_len == 0:  # this step's own keys, positions 0 .. seq_len - 1
        return PrefillChunk(start, end, slots=None, mask=mask)
    slots = _slots(common, torch.tensor([req], device=device), pos[None, :])[0]
    return PrefillChunk(start, end, slots=slots, mask=mask)


def _slots(common: CommonAttentionMetadata, reqs: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Flat cache slots of positions `pos [n, L]` of requests `reqs [n]` -> [n, L] int64."""
    bs = common.block_size
    blocks = torch.gather(common.block_table[reqs].long(), 1, pos // bs)  # [n, L]
    return blocks * bs + pos % bs
