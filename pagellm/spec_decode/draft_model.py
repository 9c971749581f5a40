"""Draft-model proposals (`speculative_config={"method": "draft_model", "model": ...}`): a small
model with the target's tokenizer drafts k tokens greedily. Its drafts are its argmax (one-hot
q), so the verifier accepts a draft iff the target's own draw for that position equals it.

The draft keeps its own paged KV cache with the target's number of blocks and block size, so
a request's draft K/V sit at the target's slots (the runner's block-table rows) and need no
bookkeeping of their own; the runner's KV budget pays for both (`kv_block_bytes`). The
scheduler holds k lookahead slots past each running request's scheduled tokens
(`SpeculativeConfig.num_lookahead_tokens`): the draft writes its drafts' K/V there.

Per request the proposer knows how many leading tokens the draft's cache holds (P). After a
step, for the requests that draft (L tokens each):
1. catch up: the draft over tokens P..L-1 of all of them in one flat batch (a new request's
   whole prompt; chunks of at most the runner's step buffers), its argmax at each request's
   last position is the first draft;
2. k - 1 one-token steps, each feeding the previous drafts;
3. P = L. The drafts' K/V (positions L..L+k-2) hold for those the target then accepts, so the
   next catch-up starts after them.
A request new to the proposer starts at P = 0, prefix-cache hit or not: a cached block holds
the target's K/V, the draft's only if a draft ran over it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from pagellm.config import ModelConfig, SpeculativeConfig
from pagellm.kernels.cpu_gemm import cpu_prepack_supported
from pagellm.kv_cache_size import kv_block_bytes
from pagellm.layers.rope import long_rope
from pagellm.spec_decode.proposer import Drafting, Proposer
from pagellm.utils import to_device

logger = logging.getLogger(__name__)


class DraftModelProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, model_config: ModelConfig, host: Any) -> None:
        """`host`: the runner's `DraftHost` (pagellm/worker/draft_host.py)."""
        from pagellm import loader

        self.host = host
        start = time.perf_counter()
        self.model = loader.load_model(model_config, host.device, host.attn_backend_cls)
        if cpu_prepack_supported(host.device, model_config.dtype):
            self.model.prepack_cpu_weights(batch_hint=host.max_num_seqs)
        logger.info(
            "draft model %s loaded in %.1f s: %d layers, %d drafts a step at most",
            model_config.model, time.perf_counter() - start, model_config.num_layers,
            config.num_speculative_tokens,
        )  # fmt: skip
        self.num_layers = model_config.num_layers
        self.num_kv_heads = model_config.num_kv_heads
        self.head_dim = model_config.head_dim
        self.dtype = model_config.dtype  # its cache's too
        # drafts stay in the ids both models have (equal tokenizers may pad apart)
        self.vocab_size = min(model_config.vocab_size, host.vocab_size)
        rope = long_rope(model_config.hf_config)
        self.long_rope_rows = 0 if rope is None else rope[1]
        self.kv_caches: list[torch.Tensor] = []
        self.num_cached: dict[str, int] = {}  # P: the request's leading tokens in the cache
        self.last: dict[str, tuple[int, list[int]]] = {}  # its last proposal: (L, drafts)

    def kv_block_bytes(self, block_size: int) -> int:
        itemsize = self.dtype.itemsize
        return kv_block_bytes(
            self.num_layers, self.num_kv_heads, self.head_dim, itemsize, block_size
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        host = self.host
        shape = host.attn_backend_cls.kv_cache_shape(
            num_blocks, host.block_size, self.num_kv_heads, self.head_dim
        )
        self.kv_caches = [host.zeros_kv(shape, self.dtype) for _ in range(self.num_layers)]

    def remove_request(self, req_id: str) -> None:
        self.num_cached.pop(req_id, None)
        self.last.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[Drafting]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        todo = [(i, r, k) for i, r in enumerate(requests) if (k := self._num_drafts(r)) > 0]
        if not todo:
            return out
        rows = np.array([r.row for _, r, _ in todo], np.int64)
        ends = np.array([len(r.tokens) for _, r, _ in todo], np.int64)
        starts = np.array([self._first_uncached(r) for _, r, _ in todo], np.int64)
        ks = np.array([k for _, _, k in todo], np.int64)
        drafts = self._draft(rows, starts, ends, ks)
        for (i, r, k), row_drafts in zip(todo, drafts.tolist()):
            out[i] = row_drafts[:k]
            self.num_cached[r.req_id] = len(r.tokens)
            self.last[r.req_id] = (len(r.tokens), out[i])
        return out

    def _num_drafts(self, r: Drafting) -> int:
        """Drafts for `r`: at most its `max_drafts`, those within max_model_len, those whose
        K/V have blocks (the lookahead slots: positions L..L+k-2), and those its max_tokens
        can still verify (a step with k drafts samples up to k + 1 tokens)."""
        ib, length = self.host.input_batch, len(r.tokens)
        room = int(ib.num_blocks[r.row]) * self.host.block_size - length + 1
        k = min(r.max_drafts, self.host.max_model_len - length, room)
        max_tokens = ib.params[r.row].max_tokens
        if max_tokens is not None:
            k = min(k, r.num_prompt_tokens + max_tokens - length - 1)
        return max(k, 0)

    def _first_uncached(self, r: Drafting) -> int:
        """The first of r's tokens the draft's cache lacks."""
        num_cached = self.num_cached.get(r.req_id, 0)
        return first_uncached(r.tokens, num_cached, self.last.get(r.req_id, (num_cached, [])))

    def _draft(
        self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, ks: np.ndarray
    ) -> np.ndarray:
        """[R, max(ks)] drafts (row i's first ks[i] are real), one host sync."""
        device = self.host.device
        drafts = torch.empty((len(rows), int(ks.max())), dtype=torch.int64, device=device)
        drafts[:, 0] = self._argmax(self._catch_up(rows, starts, ends))
        for j in range(1, drafts.shape[1]):
            active = np.flatnonzero(ks > j)
            index = slice(None) if len(active) == len(rows) else to_device(active, device)
            hidden = self._forward(
                rows[active], ends[active] + j - 1, np.ones(len(active), np.int64),
                drafts[index, j - 1],
            )  # fmt: skip
            drafts[index, j] = self._argmax(hidden)
        return drafts.cpu().numpy()

    def _catch_up(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> torch.Tensor:
        """The draft over tokens starts[i]..ends[i]-1 of each row, in forwards of at most the
        step buffers' size: the hidden state at each row's last token, [R, hidden]."""
        pos, out = starts.copy(), None
        while (left := ends - pos).any():
            sel = np.flatnonzero(left > 0)
            counts = left[sel]
            room = self.host.max_num_tokens - (np.cumsum(counts) - counts)
            counts = np.minimum(counts, np.maximum(room, 0))
            sel, counts = sel[counts > 0], counts[counts > 0]
            hidden = self._forward(rows[sel], pos[sel], counts)
            pos[sel] += counts
            done = pos[sel] == ends[sel]
            if out is None:
                out = hidden.new_empty((len(rows), hidden.shape[-1]))
            device = hidden.device
            last = (np.cumsum(counts) - 1)[done]
            out[to_device(sel[done], device)] = hidden[to_device(last, device)]
        return out

    def _forward(
        self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, input_ids=None
    ) -> torch.Tensor:
        host = self.host
        return host.forward(
            self.model, self.kv_caches, rows, starts, counts, input_ids, self.long_rope_rows
        )

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N] the draft's most likely next tokens."""
        return self.model.compute_logits(hidden)[:, : self.vocab_size].argmax(dim=-1)


def first_uncached(tokens: np.ndarray, num_cached: int, last: tuple[int, list[int]]) -> int:
    """The first of `tokens` [L] whose K/V the draft's cache lacks: `num_cached`, past the
    drafts of the last proposal (`last`: (its L, its drafts), whose K/V it wrote then but for
    the last draft's) that the tokens turned out to repeat; at most L - 1 (the next draft
    comes from the last token's forward)."""
    start, (proposed_at, drafts) = num_cached, last
    if proposed_at == start:
        n = 0
        while (
            n < len(drafts) - 1 and start + n < len(tokens) - 1 and tokens[start + n] == drafts[n]
        ):
            n += 1
        start += n
    return min(start, len(tokens) - 1)
