"""KVCacheManager: block tables, chain hashes, prefix-cache hits with exact block ids."""

from __future__ import annotations

import os

import pytest
import torch

from pagellm.core.kv_cache_manager import ROOT_BLOCK_HASH, KVCacheManager, hash_block_tokens
from pagellm.core.request import Request
from pagellm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=8))


def make_manager(num_blocks: int = 11, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BLOCK_SIZE, num_blocks, max_model_len=64, enable_caching=enable_caching)


def admit(manager: KVCacheManager, request: Request) -> tuple[int, list[int] | None]:
    """What the scheduler does for a waiting request given the whole budget."""
    hits, num_computed = manager.get_computed_blocks(request)
    new_ids = manager.allocate_slots(request, request.num_tokens - num_computed, hits)
    if new_ids is not None:
        request.num_computed_tokens = request.num_tokens
    return num_computed, new_ids


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_queue.get_all_free_blocks()]


def test_block_hashes_are_a_chain_over_full_blocks():
    manager = make_manager()
    request = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    manager.get_computed_blocks(request)
    first = hash_block_tokens(ROOT_BLOCK_HASH, (0, 1, 2, 3))
    assert request.block_hashes == [first, hash_block_tokens(first, (4, 5, 6, 7))]
    # same block tokens after a different prefix hash differently
    other = make_request("b", [9, 9, 9, 9, 4, 5, 6, 7])
    manager.get_computed_blocks(other)
    assert other.block_hashes[1] != request.block_hashes[1]


def test_allocate_and_free_exact_block_ids():
    manager = make_manager()
    request = make_request("a", list(range(10)))
    assert admit(manager, request) == (0, [1, 2, 3])
    assert manager.get_block_ids("a") == [1, 2, 3]
    assert manager.num_free_blocks == 7
    # decode tokens 10, 11 fit in block 3; token 12 needs block 4
    request.append_output_token(100)
    assert manager.allocate_slots(request, 1) == []
    request.num_computed_tokens += 1
    request.append_output_token(101)
    assert manager.allocate_slots(request, 1) == []
    request.num_computed_tokens += 1
    request.append_output_token(102)
    assert manager.allocate_slots(request, 1) == [4]
    assert manager.get_block_ids("a") == [1, 2, 3, 4]
    manager.free(request)
    assert manager.get_block_ids("a") == []
    assert free_ids(manager) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]
    assert manager.usage == 0.0


def test_prefix_hit_reuses_exact_blocks():
    manager = make_manager()
    shared = list(range(8))
    a = make_request("a", shared + [50, 51, 52])
    assert admit(manager, a) == (0, [1, 2, 3])
    b = make_request("b", shared + [60, 61, 62, 63, 64])
    hits, num_computed = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2] and num_computed == 8
    assert manager.allocate_slots(b, b.num_tokens - num_computed, hits) == [4, 5]
    assert manager.get_block_ids("b") == [1, 2, 4, 5]
    assert [blk.ref_cnt for blk in hits] == [2, 2]
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (11 + 13, 8)


def test_hit_never_covers_the_last_token():
    manager = make_manager()
    a = make_request("a", list(range(8)))  # exactly two full blocks
    admit(manager, a)
    manager.free(a)
    b = make_request("b", list(range(8)))
    hits, num_computed = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1] and num_computed == 4
    # the second block is recomputed into a new block; the cached one stays cached
    assert manager.allocate_slots(b, 4, hits) == [3]
    c = make_request("c", list(range(9)))
    hits, num_computed = manager.get_computed_blocks(c)
    assert [blk.block_id for blk in hits] == [1, 2] and num_computed == 8


def test_hit_on_a_freed_prefix_revives_its_blocks():
    manager = make_manager(num_blocks=6)
    a = make_request("a", list(range(12)))
    admit(manager, a)
    manager.free(a)
    assert free_ids(manager) == [4, 5, 3, 2, 1]
    b = make_request("b", list(range(8)) + [70, 71])
    assert admit(manager, b) == (8, [4])
    assert manager.get_block_ids("b") == [1, 2, 4]
    assert free_ids(manager) == [5, 3]
    # block 3 (a's third block, tokens 8..11) is still cached and free
    assert manager.block_pool.get_cached_block(a.block_hashes[2]).block_id == 3


def test_partial_blocks_are_not_cached():
    manager = make_manager()
    a = make_request("a", list(range(6)))
    admit(manager, a)
    assert len(manager.block_pool.cached_blocks) == 1
    b = make_request("b", list(range(7)))
    _, num_computed = manager.get_computed_blocks(b)
    assert num_computed == 4
    # decode: the step computing position 6 leaves block 2 partial; position 7 fills it
    a.append_output_token(6)
    manager.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    assert len(manager.block_pool.cached_blocks) == 1
    a.append_output_token(7)
    manager.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    assert len(manager.block_pool.cached_blocks) == 2
    c = make_request("c", list(range(9)))
    hits, num_computed = manager.get_computed_blocks(c)
    assert [blk.block_id for blk in hits] == [1, 2] and num_computed == 8


def test_chunked_allocation_caches_blocks_as_they_fill():
    manager = make_manager()
    a = make_request("a", list(range(14)))
    assert manager.allocate_slots(a, 6) == [1, 2]
    a.num_computed_tokens = 6
    assert len(manager.block_pool.cached_blocks) == 1
    assert manager.allocate_slots(a, 6) == [3]
    a.num_computed_tokens = 12
    assert len(manager.block_pool.cached_blocks) == 3


def test_allocate_returns_none_without_side_effects():
    manager = make_manager(num_blocks=5)
    a = make_request("a", list(range(8)))
    admit(manager, a)
    manager.free(a)  # blocks 1, 2 free but cached
    b = make_request("b", list(range(8)) + list(range(100, 110)))  # needs 5 blocks, hits 2
    hits, num_computed = manager.get_computed_blocks(b)
    assert num_computed == 8
    before = (free_ids(manager), [blk.ref_cnt for blk in hits], manager.prefix_cache_queries)
    assert manager.allocate_slots(b, b.num_tokens - num_computed, hits) is None
    after = (free_ids(manager), [blk.ref_cnt for blk in hits], manager.prefix_cache_queries)
    assert before == after
    assert manager.get_block_ids("b") == []
    # a running request that cannot grow keeps its table as it was
    c = make_request("c", list(range(200, 216)))
    assert admit(manager, c) == (0, [3, 4, 2, 1])
    c.append_output_token(0)
    assert manager.allocate_slots(c, 1) is None
    assert manager.get_block_ids("c") == [3, 4, 2, 1]


def test_hits_on_free_blocks_count_against_free_space():
    manager = make_manager(num_blocks=4)  # 3 usable blocks
    a = make_request("a", list(range(8)))
    admit(manager, a)
    manager.free(a)
    b = make_request("b", list(range(8)) + [1, 2, 3, 4, 5])  # 2 hits + 2 new = 4 > 3
    hits, _ = manager.get_computed_blocks(b)
    assert len(hits) == 2
    assert manager.allocate_slots(b, 5, hits) is None


def test_free_then_reuse_evicts_lru_blocks():
    manager = make_manager(num_blocks=5)
    a = make_request("a", list(range(8)))
    admit(manager, a)
    manager.free(a)  # queue: 3, 4, 2, 1
    b = make_request("b", list(range(50, 62)))
    assert admit(manager, b) == (0, [3, 4, 2])  # a's tail block evicted before its head
    c = make_request("c", list(range(8)))
    hits, num_computed = manager.get_computed_blocks(c)
    assert [blk.block_id for blk in hits] == [1] and num_computed == 4


def test_caching_disabled():
    manager = make_manager(enable_caching=False)
    a = make_request("a", list(range(8)))
    admit(manager, a)
    b = make_request("b", list(range(9)))
    assert manager.get_computed_blocks(b) == ([], 0)
    assert b.block_hashes == []
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)


def test_computed_blocks_only_on_first_allocation():
    manager = make_manager()
    a = make_request("a", list(range(8)))
    admit(manager, a)
    b = make_request("b", list(range(9)))
    hits, _ = manager.get_computed_blocks(b)
    manager.allocate_slots(b, 1, hits)
    with pytest.raises(ValueError):
        manager.allocate_slots(b, 1, hits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_cpu_kv_cache_is_zeroed_without_touching_its_memory(dtype):
    """The CPU cache's pages come zeroed from the kernel on first touch: a 256 MiB layer
    costs no resident memory (nor time) until its blocks are written."""
    from pagellm.worker.kv_cache import lazily_zeroed

    def resident_bytes() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    shape = (256, 16, 4, (1 << 20) // 64 // dtype.itemsize)  # 256 MiB
    before = resident_bytes()
    cache = lazily_zeroed(shape, dtype)
    assert resident_bytes() - before < 16 << 20
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    cache[3, 5] = 1.5
    assert cache[3, 5].float().eq(1.5).all() and cache[::17].float().abs().sum() == 0
    assert cache.float().abs().sum() == 1.5 * 4 * shape[-1]
