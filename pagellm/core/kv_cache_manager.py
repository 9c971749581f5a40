"""KVCacheManager: each request's block table, and prefix caching over the BlockPool.

Prefix caching: every full block of a request gets a chain hash,
`hash_block_tokens(parent_hash, block_tokens)`, so equal hashes mean (up to a 64-bit hash
collision) equal token prefixes. A new request reuses the cached blocks of its longest
cached prefix instead of computing them again.

Sliding window: when every attention layer of the model sees only the last `sliding_window`
positions, a request never again reads a block wholly before the window of its next token
(position `num_computed_tokens`). Such blocks go back to the pool as the request grows; the
null block takes their place in its table, so block indices stay positions // block_size.
A freed block keeps its prefix-cache hash until it is reused for other tokens (eviction
drops the hash), so a hit never sees overwritten content. A prefix hit then needs only the
blocks inside the window of the hit's end; those before it may be gone.

    positions:  |  freed (null)  |  window of the next token  | next |
                0          first kept block               num_computed
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pagellm.core.block_pool import BlockPool, KVCacheBlock
from pagellm.core.request import Request
from pagellm.kv_cache_size import cdiv, kv_capacity_tokens
from pagellm.kv_cache_size import max_request_len as cache_max_request_len

logger = logging.getLogger(__name__)

# Parent hash of a request's first block. A fixed int, not None: hash(None) is not stable
# across processes before Python 3.12.
ROOT_BLOCK_HASH = 0x5DEECE66D
# the first block's parent for a request rotated with longrope's long factors: its K/V differ
LONG_ROPE_ROOT_HASH = hash((ROOT_BLOCK_HASH, "long_rope"))


def hash_block_tokens(parent_hash: int, block_token_ids: tuple[int, ...]) -> int:
    """Chain hash of one full block: Python's tuple hash, fast and deterministic for ints
    (PYTHONHASHSEED only salts str/bytes). 64 bits, not cryptographic: fine for trusted
    token ids inside one engine process."""
    return hash((parent_hash, block_token_ids))


class _RequestBlocks:
    """A request's block table, how many of its leading blocks are in the prefix cache and
    how many are the null block (freed: outside the sliding window)."""

    __slots__ = ("blocks", "num_cached_blocks", "num_null_blocks")

    def __init__(self) -> None:
        self.blocks: list[KVCacheBlock] = []
        self.num_cached_blocks = 0
        self.num_null_blocks = 0


class KVCacheManager:
    """Allocates blocks to requests as their computed tokens grow; frees them when done."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,  # set only if every layer is windowed (the largest)
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self._reqs: dict[str, _RequestBlocks] = {}
        # since start, in tokens; counted once per admission (see allocate_slots)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def max_request_len(self, max_num_batched_tokens: int) -> int:
        """The longest request the cache holds: max_model_len, or fewer tokens if the whole
        cache holds fewer (blocks outside a window are freed: then a step needs at most the
        window before its first token and a full token budget after it)."""
        num_blocks = self.block_pool.num_blocks
        longest = cache_max_request_len(
            num_blocks, self.block_size, self.max_model_len, self.sliding_window,
            max_num_batched_tokens,
        )  # fmt: skip
        if longest < self.max_model_len:
            logger.warning(
                "%d KV blocks of %d tokens hold only %d tokens: requests stop there, "
                "below max_model_len=%d (max_model_len='auto' fits it to the cache)",
                num_blocks, self.block_size, kv_capacity_tokens(num_blocks, self.block_size),
                self.max_model_len,
            )  # fmt: skip
        return longest

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks of the request's longest cached prefix, and its length in tokens.

        The hit never covers the last token: it must be computed to sample the next one. A
        request that wants prompt logprobs gets no hit: every prompt position is computed.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request, request.num_tokens)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_hit_blocks]
        if self.sliding_window is not None:
            return self._window_hits(hashes)
        hits = []
        for block_hash in hashes:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _window_hits(self, hashes: list[int]) -> tuple[list[KVCacheBlock], int]:
        """The longest prefix whose last blocks, those inside the window of the token after
        it, are all cached; the blocks before them come back as the null block."""
        found: list[KVCacheBlock | None] = []
        num_hit, run = 0, 0  # run: cached blocks ending at the current one
        for block_hash in hashes:
            block = self.block_pool.get_cached_block(block_hash)
            found.append(block)
            run = run + 1 if block is not None else 0
            n = len(found)
            if run >= n - self._first_kept_block(n * self.block_size):
                num_hit = n
        skip = self._first_kept_block(num_hit * self.block_size)
        hits = [self.block_pool.null_block] * skip + found[skip:num_hit]
        return hits, num_hit * self.block_size

    def _first_kept_block(self, num_computed: int) -> int:
        """The first block the token at position `num_computed`, or a later one, may read."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones, and for
        `num_lookahead_tokens` slots after those (a draft model writes its drafts' K/V there).

        `new_computed_blocks` (first allocation only) are prefix-cache hits from
        `get_computed_blocks`; they come before the new tokens. Returns the ids of the blocks
        appended to the request's table (maybe []), or None, changing nothing, if too few
        blocks are free. Blocks this step fills are cached right away.
        """
        req_blocks = self._reqs.get(request.request_id)
        if req_blocks is None:
            return self._allocate_first(
                request, num_new_tokens, new_computed_blocks, num_lookahead_tokens
            )
        if new_computed_blocks:
            raise ValueError("prefix-cache hits are only taken on a request's first allocation")
        self._free_outside_window(req_blocks, request.num_computed_tokens)
        num_total = request.num_computed_tokens + num_new_tokens
        return self._grow(request, req_blocks, num_total, num_lookahead_tokens)

    def _allocate_first(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVCacheBlock],
        num_lookahead: int,
    ) -> list[int] | None:
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        num_needed = cdiv(num_total + num_lookahead, self.block_size) - len(computed_blocks)
        # hits before the window are not taken (the null block stands in for them)
        skip = min(self._first_kept_block(num_computed), len(computed_blocks))
        # hits on free cached blocks take them out of the free queue too
        num_revived = sum(1 for block in computed_blocks[skip:] if block.ref_cnt == 0)
        if num_needed + num_revived > self.block_pool.num_free_blocks:
            return None
        req_blocks = self._admit(request, computed_blocks, skip)
        return self._grow(request, req_blocks, num_total, num_lookahead)

    def _grow(
        self, request: Request, req_blocks: _RequestBlocks, num_total: int, num_lookahead: int = 0
    ) -> list[int] | None:
        """Extend the request's table to hold `num_total` tokens and `num_lookahead` slots
        after them; cache the blocks its known tokens fill (never a lookahead slot's)."""
        blocks = req_blocks.blocks
        num_needed = cdiv(num_total + num_lookahead, self.block_size) - len(blocks)
        new_block_ids = []
        if num_needed < 0:  # held for rejected drafts or a longer lookahead: never cached
            surplus = blocks[num_needed:]
            del blocks[num_needed:]
            self.block_pool.free_blocks(reversed(surplus))
        elif num_needed > 0:
            if num_needed > self.block_pool.num_free_blocks:
                return None
            new_blocks = self.block_pool.get_new_blocks(num_needed)
            blocks.extend(new_blocks)
            new_block_ids = [block.block_id for block in new_blocks]
        num_known = min(num_total, request.num_tokens)  # tokens whose ids are all known
        if self.enable_caching and num_known // self.block_size > req_blocks.num_cached_blocks:
            self._cache_full_blocks(request, req_blocks, num_known)
        return new_block_ids

    def _admit(
        self, request: Request, computed_blocks: Sequence[KVCacheBlock], skip: int
    ) -> _RequestBlocks:
        """Start a request's block table with its prefix-cache hits, the first `skip` of them
        (outside the window) as the null block."""
        self.block_pool.touch(computed_blocks[skip:])
        req_blocks = _RequestBlocks()
        req_blocks.blocks.extend([self.block_pool.null_block] * skip)
        req_blocks.blocks.extend(computed_blocks[skip:])
        req_blocks.num_cached_blocks = len(computed_blocks)
        req_blocks.num_null_blocks = skip
        self._reqs[request.request_id] = req_blocks
        if self.enable_caching:
            # counted here, not at lookup, so a request left waiting for blocks counts once
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(computed_blocks) * self.block_size
        return req_blocks

    def _free_outside_window(self, req_blocks: _RequestBlocks, num_computed: int) -> None:
        """Return the blocks wholly before the window of position `num_computed` to the pool
        (latest first, as `free`), the null block taking their place."""
        first_kept = min(self._first_kept_block(num_computed), len(req_blocks.blocks))
        start = req_blocks.num_null_blocks
        if first_kept <= start:
            return
        freed = req_blocks.blocks[start:first_kept]
        req_blocks.blocks[start:first_kept] = [self.block_pool.null_block] * len(freed)
        req_blocks.num_null_blocks = first_kept
        self.block_pool.free_blocks(reversed(freed))

    def _cache_full_blocks(
        self, request: Request, req_blocks: _RequestBlocks, num_known_tokens: int
    ) -> None:
        """Cache the blocks made full by the first `num_known_tokens` tokens."""
        num_full = num_known_tokens // self.block_size
        first = req_blocks.num_cached_blocks
        self._update_block_hashes(request, num_full * self.block_size)
        self.block_pool.cache_full_blocks(
            req_blocks.blocks[first:num_full], request.block_hashes[first:num_full]
        )
        req_blocks.num_cached_blocks = num_full

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend `request.block_hashes` to cover the full blocks of its first num_tokens."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        size = self.block_size
        root = LONG_ROPE_ROOT_HASH if request.long_rope else ROOT_BLOCK_HASH
        if request.lora_request is not None:  # an adapter's K/V are its own
            root = hash((root, "lora", request.lora_request.lora_int_id))
        parent = hashes[-1] if hashes else root
        for start in range(len(hashes) * size, num_tokens - size + 1, size):
            parent = hash_block_tokens(parent, tuple(tokens[start : start + size]))
            hashes.append(parent)

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first (it is the least likely to be shared)."""
        req_blocks = self._reqs.pop(request.request_id, None)
        if req_blocks is not None:
            self.block_pool.free_blocks(reversed(req_blocks.blocks))

    def num_blocks(self, request_id: str) -> int:
        """Blocks in the request's table (the null block counted)."""
        req_blocks = self._reqs.get(request_id)
        return len(req_blocks.blocks) if req_blocks else 0

    def get_block_ids(self, request_id: str) -> list[int]:
        """A fresh list of the request's block ids, in order."""
        req_blocks = self._reqs.get(request_id)
        return [block.block_id for block in req_blocks.blocks] if req_blocks else []

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
