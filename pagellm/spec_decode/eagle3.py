"""EAGLE-3 proposals (`speculative_config={"method": "eagle3", "model": <head folder>}`): a one-
layer head (`pagellm/models/eagle3.py`) drafts from the target's own hidden states.

The target keeps, at each forward, its residual stream entering three of its layers
(`LlamaModel.aux_hidden_layers`): position p's feature. The head's input at p is that feature
and the token after p, so the head's K/V of position p can be written once token p + 1 is
known: right after the forward for a prompt chunk (`after_forward`: its next tokens are prompt
tokens), after sampling for the rest (`propose`: the accepted drafts and the new token; the
features of rejected drafts are dropped). Every computed position of every request is fed,
whether or not it drafts, so the head's cache (its own paged tensors at the target's block
ids, as a draft model's: `DraftModelProposer`) is complete up to each request's last token;
a prefix-cache hit brings the head's K/V of its blocks with it (written by the request that
computed them).

A request of L tokens drafts from the head's output at position L - 2 (its input: the feature
of L - 2 and token L - 1): the draft d1 for position L; then k - 1 one-token steps, each
feeding the previous draft with the head's own previous output as its feature. Drafts are the
argmax over the head's vocabulary, mapped to the target's (`d2t`).
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Any

import numpy as np
import torch

from pagellm.config import ModelConfig, SpeculativeConfig
from pagellm.models.eagle3 import aux_hidden_layers
from pagellm.models.llama import LlamaModel
from pagellm.spec_decode.draft_model import DraftModelProposer
from pagellm.spec_decode.proposer import Drafting
from pagellm.utils import to_device


class Eagle3Proposer(DraftModelProposer):
    method = "eagle3"

    def __init__(self, config: SpeculativeConfig, model_config: ModelConfig, host: Any) -> None:
        super().__init__(config, model_config, host)  # the head, its cache
        target = getattr(host.target_model, "model", None)
        if not isinstance(target, LlamaModel):
            raise ValueError(
                f"speculative_config method {self.method!r} drafts for a Llama-family decoder "
                f"(Llama, Mistral, Qwen2, Qwen3, ...), not {type(host.target_model).__name__}"
            )
        self.model.use_target_embedding(target.embed_tokens)
        self.target = target
        self.attach(model_config)
        # forwards whose sampled tokens are not back yet, oldest first (async scheduling: two):
        # each one's batch, features [T, 3 H] and its rows' positions fed so far
        self.steps: deque[tuple[Any, torch.Tensor, np.ndarray]] = deque()

    def attach(self, model_config: ModelConfig) -> None:
        """Have the target keep what the head reads: the residual stream entering 3 layers."""
        target = self.target
        target.aux_hidden_layers = aux_hidden_layers(model_config.hf_config, len(target.layers))

    def step_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's inputs of this step's positions, [T, 3 H] (`hidden`: the target's
        output)."""
        return self.target.aux_hidden_states

    def after_forward(self, batch: Any, hidden: torch.Tensor) -> None:
        """Feed the positions whose next token is known (prompt chunks); keep the features of
        the rest (the rows that sample) until the step's tokens are back."""
        features = self.step_features(hidden)  # [T, 3 H]
        first = (batch.seq_lens - batch.num_scheduled).astype(np.int64)  # [R]
        known = self.host.input_batch.num_tokens[batch.rows] - 1  # positions with a next token
        ends = np.minimum(batch.seq_lens, known)
        self._feed(batch, features, first, ends, np.arange(len(batch.rows)))
        fed = np.maximum(first, ends)
        if (fed < batch.seq_lens).any():  # rows that sample: the step's read-back proposes
            self.steps.append((batch, features, fed))

    @torch.inference_mode()
    def propose(self, requests: list[Drafting]) -> list[list[int]]:
        """After the oldest step in flight: feed its rows up to their new tokens, draft."""
        out: list[list[int]] = [[] for _ in requests]
        if not self.steps:
            return out
        batch, features, fed = self.steps.popleft()
        ib = self.host.input_batch
        held = np.fromiter(
            (ib.req_id_to_row.get(r) == row for r, row in zip(batch.req_ids, batch.rows.tolist())),
            bool, len(batch.rows),
        )  # fmt: skip
        sel = np.flatnonzero(held)
        # up to the step's new tokens (a step queued after it: its positions are not this one's)
        ends = np.minimum(batch.seq_lens[sel], ib.num_tokens[batch.rows[sel]] - 1)
        hidden = self._feed(batch, features, fed[sel], ends, sel)
        if hidden is None:
            return out
        # each fed row's last output: position L - 2 of a request that sampled
        counts = np.maximum(ends - fed[sel], 0)
        last = {
            int(batch.rows[i]): int(end) - 1
            for i, n, end in zip(sel, counts, np.cumsum(counts))
            if n
        }
        wanted = [(i, r) for i, r in enumerate(requests) if r.row in last]
        todo = [(i, r, k) for i, r in wanted if (k := self._num_drafts(r)) > 0]
        if todo:
            index = to_device(np.array([last[r.row] for _, r, _ in todo], np.int64), hidden.device)
            drafts = self._draft_from(hidden[index], todo)
            for (i, _, k), row_drafts in zip(todo, drafts.tolist()):
                out[i] = row_drafts[:k]
        return out

    def _feed(
        self, batch: Any, features: torch.Tensor, starts: np.ndarray, ends: np.ndarray,
        sel: np.ndarray,
    ) -> torch.Tensor | None:  # fmt: skip
        """The head over positions starts[j] .. ends[j] - 1 of batch row sel[j] (features of
        this step; input: the token after each): its outputs [T', hidden], or None."""
        counts = np.maximum(ends - starts, 0)
        keep = counts > 0
        if not keep.any():
            return None
        sel, starts, counts = sel[keep], starts[keep], counts[keep]
        ib, rows = self.host.input_batch, batch.rows[sel]
        first = batch.seq_lens[sel] - batch.num_scheduled[sel]
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        positions = np.repeat(starts, counts) + offsets
        index = np.repeat(batch.query_start_loc[sel] + (starts - first), counts) + offsets
        device = features.device
        next_ids = ib.token_ids[np.repeat(rows, counts), positions + 1]
        head = functools.partial(self.model, feature=features[to_device(index, device)])
        return self.host.forward(
            head, self.kv_caches, rows, starts, counts, to_device(next_ids, device)
        )

    def _draft_from(
        self, hidden: torch.Tensor, todo: list[tuple[int, Drafting, int]]
    ) -> np.ndarray:
        """[R, max k] drafts from each request's output at position L - 2 (`hidden` [R, H])."""
        rows = np.array([r.row for _, r, _ in todo], np.int64)
        ends = np.array([len(r.tokens) for _, r, _ in todo], np.int64)
        ks = np.array([k for _, _, k in todo], np.int64)
        device = hidden.device
        drafts = torch.empty((len(rows), int(ks.max())), dtype=torch.int64, device=device)
        drafts[:, 0] = self._argmax(hidden)
        hidden = hidden.clone()  # [R, H]: each request's latest output, its next feature
        for j in range(1, drafts.shape[1]):
            active = np.flatnonzero(ks > j)
            index = slice(None) if len(active) == len(rows) else to_device(active, device)
            head = functools.partial(self.model, feature=hidden[index])
            out = self.host.forward(
                head, self.kv_caches, rows[active], ends[active] + j - 2,
                np.ones(len(active), np.int64), drafts[index, j - 1],
            )  # fmt: skip
            hidden[index] = out
            drafts[index, j] = self._argmax(out)
        return drafts.cpu().numpy()

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N] the head's most likely next tokens, as target ids."""
        return self.model.to_target_ids(self.model.compute_logits(hidden).argmax(dim=-1))
