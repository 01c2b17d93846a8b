"""BlockPool: exact block ids, refcounts, LRU eviction order, stale hashes, verified hits."""
import pytest

from minillm.cache.block_pool import BlockPool
from minillm.cache.hashing import ROOT_HASH, hash_block

BS = 4


def toks(start: int) -> tuple[int, ...]:
    return tuple(range(start, start + BS))


def publish(pool: BlockPool, block_id: int, tokens: tuple[int, ...], parent=ROOT_HASH) -> int:
    h = hash_block(parent, tokens)
    pool.cache_block(block_id, h, parent, tokens)
    return h


def assert_pool_empty(pool: BlockPool) -> None:
    pool.check_integrity([0] * pool.num_blocks)
    assert pool.num_free_blocks == pool.num_blocks


def test_allocate_takes_head_and_free_appends_to_tail():
    pool = BlockPool(6, BS, enable_caching=True)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.ref_cnt == [1, 1, 1, 0, 0, 0]
    assert pool.free_block_ids() == [3, 4, 5]
    pool.free([2, 1, 0])
    assert pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert pool.allocate(4) == [3, 4, 5, 2]
    pool.free([3, 4, 5, 2])
    assert_pool_empty(pool)


def test_touch_shares_a_block_and_takes_it_out_of_the_free_queue():
    pool = BlockPool(4, BS, enable_caching=True)
    [b] = pool.allocate(1)
    h = publish(pool, b, toks(0))
    pool.free([b])
    assert b in pool.free_block_ids()
    assert pool.lookup(h, ROOT_HASH, toks(0)) == b     # cached content survives the free
    pool.touch([b])
    pool.touch([b])
    assert pool.ref_cnt[b] == 2 and b not in pool.free_block_ids()
    pool.free([b])
    assert pool.ref_cnt[b] == 1 and b not in pool.free_block_ids()
    pool.free([b])
    assert_pool_empty(pool)


def test_cached_free_blocks_are_evicted_in_lru_order_and_stale_hashes_cleared():
    pool = BlockPool(3, BS, enable_caching=True)
    blocks = pool.allocate(3)
    hashes = [publish(pool, b, toks(10 * b)) for b in blocks]
    pool.free([1, 0, 2])                                 # free queue: 1, 0, 2
    assert pool.allocate(1) == [1]                        # the least recently freed goes first
    assert pool.block_hash(1) is None
    assert pool.lookup(hashes[1], ROOT_HASH, toks(10)) is None   # stale hash gone with the reuse
    assert pool.lookup(hashes[0], ROOT_HASH, toks(0)) == 0       # others still cached
    assert pool.num_cached_blocks == 2
    pool.free([1])
    pool.check_integrity([0, 0, 0])


def test_lookup_verifies_parent_and_tokens_not_just_the_hash():
    pool = BlockPool(2, BS, enable_caching=True)
    [b] = pool.allocate(1)
    pool.cache_block(b, 12345, ROOT_HASH, toks(0))       # pretend 12345 is this content's hash
    assert pool.lookup(12345, ROOT_HASH, toks(0)) == b
    assert pool.lookup(12345, ROOT_HASH, toks(1)) is None        # same hash, other tokens: a collision
    assert pool.lookup(12345, 999, toks(0)) is None              # same tokens, other prefix
    pool.free([b])
    assert_pool_empty(pool)


def test_cache_block_keeps_one_block_per_hash_and_only_full_blocks():
    pool = BlockPool(3, BS, enable_caching=True)
    a, b = pool.allocate(2)
    h = publish(pool, a, toks(0))
    publish(pool, b, toks(0))                            # same content computed twice in one step
    assert pool.block_hash(b) is None and pool.lookup(h, ROOT_HASH, toks(0)) == a
    with pytest.raises(ValueError, match="full blocks"):
        pool.cache_block(b, 7, ROOT_HASH, (1, 2))
    pool.free([a, b])
    assert_pool_empty(pool)


def test_caching_disabled_never_publishes():
    pool = BlockPool(2, BS, enable_caching=False)
    [b] = pool.allocate(1)
    h = publish(pool, b, toks(0))
    assert pool.lookup(h, ROOT_HASH, toks(0)) is None and pool.num_cached_blocks == 0
    pool.free([b])
    assert_pool_empty(pool)


def test_over_allocation_and_double_free_are_refused_without_change():
    pool = BlockPool(2, BS, enable_caching=True)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.allocate(3)
    assert pool.free_block_ids() == [0, 1]
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError, match="freed more often"):
        pool.free([b])
    assert_pool_empty(pool)


def test_check_integrity_reports_a_refcount_mismatch():
    pool = BlockPool(3, BS, enable_caching=True)
    pool.allocate(2)
    pool.check_integrity([1, 1, 0])
    with pytest.raises(AssertionError, match="block 1: refcount 1, but 0"):
        pool.check_integrity([1, 0, 0])
    pool.free([0, 1])
    assert_pool_empty(pool)


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2, BS, enable_caching=True)
    [b] = pool.allocate(1)
    h = publish(pool, b, toks(0))
    assert pool.reset_prefix_cache() is False
    pool.free([b])
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(h, ROOT_HASH, toks(0)) is None
    assert_pool_empty(pool)


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_blocks=0, block_size=4), "num_blocks"),
    (dict(num_blocks=4, block_size=0), "block_size"),
])
def test_bad_sizes_are_rejected(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BlockPool(enable_caching=True, **kwargs)


def test_hash_chains_parent_tokens_and_extra_keys():
    h1 = hash_block(ROOT_HASH, toks(0))
    assert h1 == hash_block(ROOT_HASH, toks(0))
    assert hash_block(h1, toks(4)) != hash_block(ROOT_HASH, toks(4))
    assert hash_block(ROOT_HASH, toks(0), ("adapter-a",)) != h1
