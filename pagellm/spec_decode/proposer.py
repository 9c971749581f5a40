"""Proposers: after a step, drafts for each request that sampled.

A proposer sees each request's tokens (prompt + accepted outputs, the runner's row) and how
many drafts it may propose; model-free proposers (ngram, suffix) work on the host, a draft
model on the device (`pagellm/spec_decode/draft_model.py`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from pagellm.config import SpeculativeConfig
from pagellm.spec_decode.ngram import ngram_drafts


class Drafting(NamedTuple):
    """One request to draft for: its id, InputBatch row, tokens and the drafts wanted."""

    req_id: str
    row: int
    tokens: np.ndarray  # [L] its prompt and outputs (a view of the runner's row)
    num_prompt_tokens: int
    max_drafts: int


class Proposer:
    def propose(self, requests: list[Drafting]) -> list[list[int]]:
        """Up to `max_drafts` draft ids for each request (maybe none)."""
        raise NotImplementedError

    def remove_request(self, req_id: str) -> None:
        """The request left the runner (finished or preempted)."""

    def after_forward(self, batch: Any, hidden: Any) -> None:
        """The step's forward is done (`batch`: its `StepBatch`; `hidden` [T, hidden]: the
        target's output), its tokens not yet sampled: a head that reads the target's hidden
        states takes this step's here."""

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one block of the proposer's own KV cache (a draft model's): the runner's
        KV budget buys blocks of the target's and of this together."""
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate that cache: `num_blocks` blocks, at the target's block ids."""


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, requests: list[Drafting]) -> list[list[int]]:
        return [ngram_drafts(r.tokens, self.min_n, self.max_n, r.max_drafts) for r in requests]


class SuffixTreeProposer(Proposer):
    """`SuffixProposer` (a suffix tree over this request and recent requests' outputs) fed
    the tokens each request gained since its last proposal."""

    def __init__(self, config: SpeculativeConfig) -> None:
        from pagellm.spec_decode.suffix import SuffixProposer

        self.tree = SuffixProposer(
            config.num_speculative_tokens,
            max_tree_depth=config.suffix_decoding_max_tree_depth,
            max_cached_requests=config.suffix_decoding_max_cached_requests,
            max_spec_factor=config.suffix_decoding_max_spec_factor,
            min_token_prob=config.suffix_decoding_min_token_prob,
        )
        self.num_seen: dict[str, int] = {}  # tokens of each request the tree has

    def propose(self, requests: list[Drafting]) -> list[list[int]]:
        drafts = []
        for r in requests:
            seen = self.num_seen.get(r.req_id)
            if seen is None:
                self.tree.start_request(r.req_id, r.tokens[: r.num_prompt_tokens].tolist())
                seen = r.num_prompt_tokens
            if len(r.tokens) > seen:
                self.tree.add_tokens(r.req_id, r.tokens[seen:].tolist())
            self.num_seen[r.req_id] = len(r.tokens)
            drafts.append(self.tree.propose(r.req_id, r.max_drafts) if r.max_drafts else [])
        return drafts

    def remove_request(self, req_id: str) -> None:
        if self.num_seen.pop(req_id, None) is not None:
            self.tree.stop_request(req_id)
