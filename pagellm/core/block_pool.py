"""BlockPool: the KV cache's pages, their reference counts, the free queue and the prefix cache.

A block is either in use (ref_cnt > 0, held by one or more requests) or free (ref_cnt == 0,
in the free queue). A free block may still hold a cached prefix (its `block_hash` is set):
it can be revived by a prefix-cache hit (`touch`) until `get_new_blocks` evicts it.
The free queue is in eviction order: the front goes first, so freed blocks go to the back
(least recently used first).

Block 0 is the null block: never handed out, never freed; block tables are padded with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

NULL_BLOCK_ID = 0


class KVCacheBlock:
    """One page of `block_size` token slots; also a node of the free queue."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None  # set while the block is in the prefix cache
        # free-queue links; both None while the block is not in the queue
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Intrusive doubly-linked list of free blocks: O(1) popleft, append and remove.

    Two sentinel nodes (head, tail) mean no link is ever None for a block in the queue.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Front to back (eviction order). O(n): for tests and debugging."""
        blocks = []
        block = self._head.next_free
        while block is not self._tail:
            blocks.append(block)
            block = block.next_free
        return blocks


class BlockPool:
    """All KV blocks of the cache, the free queue and the hash -> block map of cached blocks.

    Invariant: `block.block_hash is not None` iff `cached_blocks[block.block_hash] is block`.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[int, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can get now: never used, or free but still holding a cached prefix."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks in use, 0..1 (the null block is not counted)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the front of the free queue, evicting their cached prefixes."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} blocks, only {self.num_free_blocks} free")
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        del self.cached_blocks[block.block_hash]
        block.block_hash = None

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; those left unreferenced join the back of the queue.

        Callers pass a request's blocks last-first, so its tail blocks are evicted first. The
        null block (standing in for blocks freed outside a sliding window) is skipped.
        """
        for block in blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to prefix-cache hits; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[int]
    ) -> None:
        """Record `block_hashes[i] -> blocks[i]` for blocks whose tokens are all known.

        A block already cached is left alone. If another block already holds the same hash
        (two requests computed the same prefix at once), this one stays uncached. The null
        block (a block freed outside a sliding window before it was cached) is skipped.
        """
        if not self.enable_caching:
            return
        for block, block_hash in zip(blocks, block_hashes):
            if block is self.null_block:
                continue
            if block.block_hash is None and block_hash not in self.cached_blocks:
                block.block_hash = block_hash
                self.cached_blocks[block_hash] = block

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Refused (returns False) while any block is in use:
        a running request would go on caching blocks computed before the reset."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True
