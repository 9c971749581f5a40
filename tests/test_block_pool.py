"""BlockPool and its free queue: exact block ids, queue order, ref counts, eviction."""

from __future__ import annotations

import pytest

from pagellm.core.block_pool import NULL_BLOCK_ID, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue.get_all_free_blocks()]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def test_free_queue_popleft_append_remove():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert len(queue) == 5
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[2])  # from the middle
    queue.remove(blocks[4])  # the last one
    queue.append(blocks[0])
    assert ids(queue.get_all_free_blocks()) == [1, 3, 0]
    assert queue.num_free_blocks == 3
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    for _ in range(3):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()


def test_null_block_never_handed_out():
    pool = BlockPool(5)
    assert pool.null_block.block_id == NULL_BLOCK_ID
    assert pool.num_free_blocks == 4
    assert NULL_BLOCK_ID not in free_ids(pool)
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_new_blocks_in_order_and_free_in_given_order():
    pool = BlockPool(10)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(2)
    assert ids(a) == [1, 2, 3] and ids(b) == [4, 5]
    assert all(block.ref_cnt == 1 for block in a + b)
    assert pool.usage == pytest.approx(5 / 9)
    pool.free_blocks(reversed(a))  # a request's blocks, tail first
    assert free_ids(pool) == [6, 7, 8, 9, 3, 2, 1]
    pool.free_blocks(reversed(b))
    assert free_ids(pool) == [6, 7, 8, 9, 3, 2, 1, 5, 4]
    # reuse follows the queue: never-used blocks first, then a's tail block
    assert ids(pool.get_new_blocks(5)) == [6, 7, 8, 9, 3]


def test_ref_counts_with_shared_prefix():
    pool = BlockPool(8)
    prefix = pool.get_new_blocks(2)
    pool.cache_full_blocks(prefix, [101, 102])
    pool.touch(prefix)  # a second request hits the cached prefix while the first holds it
    assert [block.ref_cnt for block in prefix] == [2, 2]
    assert pool.num_free_blocks == 5
    pool.free_blocks(reversed(prefix))  # first request done
    assert [block.ref_cnt for block in prefix] == [1, 1]
    assert free_ids(pool) == [3, 4, 5, 6, 7]
    pool.free_blocks(reversed(prefix))  # second request done
    assert free_ids(pool) == [3, 4, 5, 6, 7, 2, 1]
    assert pool.get_cached_block(101) is prefix[0]  # free but still cached


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [11, 12, 13])
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 5, 3, 2, 1]
    hit = pool.get_cached_block(12)
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert free_ids(pool) == [4, 5, 3, 1]
    assert pool.num_free_blocks == 4


def test_eviction_in_lru_order_drops_hash():
    pool = BlockPool(4)
    first = pool.get_new_blocks(1)
    second = pool.get_new_blocks(2)
    pool.cache_full_blocks(first, [7])
    pool.cache_full_blocks(second, [8, 9])
    pool.free_blocks(first)  # least recently used
    pool.free_blocks(reversed(second))
    assert free_ids(pool) == [1, 3, 2]
    (evicted,) = pool.get_new_blocks(1)
    assert evicted.block_id == 1 and evicted.block_hash is None
    assert pool.get_cached_block(7) is None
    assert pool.get_cached_block(8) is second[0] and pool.get_cached_block(9) is second[1]
    assert ids(pool.get_new_blocks(1)) == [3]
    assert pool.get_cached_block(9) is None


def test_cache_full_blocks_keeps_first_block_for_a_hash():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [5])
    pool.cache_full_blocks([b], [5])  # same content computed twice at once
    assert pool.get_cached_block(5) is a
    assert b.block_hash is None
    pool.cache_full_blocks([a], [6])  # already cached: unchanged
    assert a.block_hash == 5 and pool.get_cached_block(6) is None


def test_caching_disabled_records_nothing():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [1, 2])
    assert pool.get_cached_block(1) is None
    assert all(block.block_hash is None for block in blocks)


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [1, 2])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(1) is blocks[0]
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(1) is None and pool.get_cached_block(2) is None
    assert all(block.block_hash is None for block in blocks)
    assert pool.num_free_blocks == 3
