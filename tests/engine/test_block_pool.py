"""BlockPool: allocation order, reference counts, the LRU free queue and the cache index."""

import pytest

from jvllm.engine.kv.block_pool import NULL_BLOCK, ROOT_CONTENT_ID, BlockPool


def _cache(pool: BlockPool, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> int:
    content_id = pool.register(block_id, block_hash, ROOT_CONTENT_ID, tokens)
    assert content_id is not None
    return content_id


def test_allocation_never_hands_out_the_null_block():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4
    assert pool.allocate(4) == [1, 2, 3, 4]
    assert NULL_BLOCK not in pool.free_block_ids()
    assert pool.num_free_blocks == 0
    with pytest.raises(AssertionError):
        pool.allocate(1)


def test_ref_counts_and_double_free():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.incref([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.ref_count(block) == 1 and block not in pool.free_block_ids()
    pool.free([block])
    assert pool.ref_count(block) == 0 and block in pool.free_block_ids()
    with pytest.raises(AssertionError, match="double free"):
        pool.free([block])


def test_null_block_cannot_be_freed_or_shared():
    pool = BlockPool(3)
    with pytest.raises(AssertionError):
        pool.free([NULL_BLOCK])
    with pytest.raises(AssertionError):
        pool.incref([NULL_BLOCK])


def test_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    _cache(pool, blocks[0], 100, (1, 2))
    pool.free(blocks)
    # Uncached blocks go to the front of the queue, the cached one waits at the back.
    assert pool.free_block_ids()[-1] == blocks[0]
    assert blocks[0] not in pool.allocate(3)
    assert pool.lookup(100, ROOT_CONTENT_ID, (1, 2)) is not None


def test_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    for block, block_hash in ((a, 10), (b, 11), (c, 12)):
        _cache(pool, block, block_hash, (block_hash,))
    pool.free([b])
    pool.free([a])
    pool.free([c])
    assert pool.allocate(1) == [b]
    assert pool.lookup(11, ROOT_CONTENT_ID, (11,)) is None  # evicted: its hash is dropped
    assert pool.cached_block(b) is None
    assert pool.lookup(10, ROOT_CONTENT_ID, (10,)).block_id == a
    assert pool.allocate(1) == [a]
    assert pool.allocate(1) == [c]


def test_a_hit_revives_a_free_cached_block():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    _cache(pool, a, 7, (7,))
    pool.free([a, b])
    pool.incref([a])
    assert pool.ref_count(a) == 1
    assert pool.free_block_ids() == [b]
    # Freed again it goes to the back: most recently used.
    pool.free([a])
    assert pool.free_block_ids() == [b, a]


def test_reviving_a_free_uncached_block_is_an_error():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError):
        pool.incref([block])


def test_lookup_checks_tokens_and_parent_not_only_the_hash():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    parent = _cache(pool, a, 1, (1, 2))
    assert pool.register(b, 2, parent, (3, 4)) is not None
    assert pool.lookup(2, parent, (3, 4)).block_id == b
    assert pool.lookup(2, parent, (3, 5)) is None  # same hash, other tokens
    assert pool.lookup(2, ROOT_CONTENT_ID, (3, 4)) is None  # same hash, other prefix
    assert pool.lookup(3, parent, (3, 4)) is None


def test_register_deduplicates_equal_content_and_refuses_collisions():
    pool = BlockPool(5)
    a, b, c = pool.allocate(3)
    content_id = _cache(pool, a, 5, (9, 9))
    assert pool.register(b, 5, ROOT_CONTENT_ID, (9, 9)) == content_id
    assert pool.cached_block(b) is None  # the first copy stays the cached one
    assert pool.register(c, 5, ROOT_CONTENT_ID, (8, 8)) is None
    assert pool.cached_block(c) is None
    assert pool.register(a, 5, ROOT_CONTENT_ID, (9, 9)) == content_id  # idempotent


def test_content_ids_are_never_reused():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    first = _cache(pool, block, 3, (3,))
    pool.free([block])
    assert pool.allocate(1) == [block]  # evicts
    assert _cache(pool, block, 3, (3,)) != first
