"""KVCacheManager: block tables, verified prefix hits, all-or-nothing allocation, reverse-order free."""
import pytest

import minillm.cache.kv_cache_manager as kvm
from minillm.cache.kv_cache_manager import KVCacheManager
from minillm.request import Request
from minillm.sampling_params import SamplingParams

BS = 4


def make_req(rid: str, tokens) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4))


def compute(kv: KVCacheManager, req: Request, num_tokens: int) -> None:
    """What one step does for a request: allocate, 'compute', publish full blocks."""
    assert kv.allocate_slots(req, num_tokens)
    req.num_computed_tokens += num_tokens
    kv.cache_full_blocks(req, req.num_computed_tokens)


def admit(kv: KVCacheManager, req: Request) -> int:
    """Admission as the scheduler does it: take the prefix hit, allocate the rest of the prompt."""
    hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - hit, hit)
    req.num_computed_tokens = hit
    return hit


def snapshot(kv: KVCacheManager, *reqs: Request):
    pool = kv.pool
    return (list(pool.ref_cnt), pool.free_block_ids(), dict(pool._cached), list(pool._block_hash),
            [list(r.block_ids) for r in reqs], [r.num_computed_tokens for r in reqs])


def assert_empty(kv: KVCacheManager) -> None:
    kv.check_integrity([])
    assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0
    assert all(c == 0 for c in kv.pool.ref_cnt) and not kv._state


def test_block_table_grows_block_by_block():
    kv = KVCacheManager(8, BS, enable_caching=True, max_model_len=32)
    a = make_req("tbl-a", range(10))
    assert kv.allocate_slots(a, 10) and a.block_ids == [0, 1, 2]
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2) and a.block_ids == [0, 1, 2]        # 12 tokens still fit 3 blocks
    assert kv.allocate_slots(a, 3) and a.block_ids == [0, 1, 2, 3]
    assert kv.usage == 0.5
    kv.check_integrity([a])
    kv.free(a)
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]        # tail of the request evicted first
    assert_empty(kv)


def test_prefix_hit_shares_blocks_with_exact_ids_and_refcounts():
    kv = KVCacheManager(8, BS, enable_caching=True, max_model_len=32)
    a = make_req("share-a", range(10))
    compute(kv, a, 10)                               # blocks 0, 1 full and published; block 2 partial
    b = make_req("share-b", list(range(8)) + [90, 91, 92])
    assert admit(kv, b) == 8
    assert b.block_ids == [0, 1, 3]
    assert kv.pool.ref_cnt[:4] == [2, 2, 1, 1]
    kv.check_integrity([a, b])
    kv.free(a)
    assert kv.pool.ref_cnt[:4] == [1, 1, 0, 1]
    kv.free(b)
    assert_empty(kv)


@pytest.mark.parametrize("prompt_len, hit", [(12, 8), (13, 12), (3, 0)])
def test_full_prompt_hit_leaves_one_token_to_compute(prompt_len, hit):
    kv = KVCacheManager(16, BS, enable_caching=True, max_model_len=32)
    a = make_req(f"full-a{prompt_len}", range(prompt_len))
    compute(kv, a, prompt_len)
    b = make_req(f"full-b{prompt_len}", range(prompt_len))
    assert kv.get_computed_blocks(b) == hit
    assert prompt_len - hit >= 1
    admit(kv, b)
    assert b.block_ids[:hit // BS] == a.block_ids[:hit // BS]
    kv.free(a)
    kv.free(b)
    assert_empty(kv)


def test_hash_collision_is_caught_by_token_verification(monkeypatch):
    # Every block hashes alike: only the stored-token check stands between a request and foreign KV.
    monkeypatch.setattr(kvm, "hash_block", lambda parent, tokens, extra_keys=(): 42)
    kv = KVCacheManager(8, BS, enable_caching=True, max_model_len=32)
    a = make_req("coll-a", range(8))
    compute(kv, a, 8)
    b = make_req("coll-b", range(100, 109))
    assert kv.get_computed_blocks(b) == 0
    c = make_req("coll-c", list(range(4)) + [7, 7, 7, 7, 7])
    assert kv.get_computed_blocks(c) == 4            # first block really matches; the second only by hash
    for r in (a, b, c):
        kv.free(r)
    assert_empty(kv)


def test_blocks_are_published_only_once_computed():
    kv = KVCacheManager(8, BS, enable_caching=True, max_model_len=32)
    a = make_req("pub-a", range(12))
    compute(kv, a, 6)                                # chunk 1: block 0 full, block 1 half written
    b = make_req("pub-b", range(12))
    assert kv.get_computed_blocks(b) == 4            # never a hit on a block still being filled
    compute(kv, a, 6)
    assert kv.get_computed_blocks(b) == 8            # capped at 11 of 12 tokens -> 2 whole blocks
    kv.free(a)
    kv.free(b)
    assert_empty(kv)


def test_failed_allocation_has_no_side_effects():
    kv = KVCacheManager(4, BS, enable_caching=True, max_model_len=64)
    a = make_req("fail-a", range(8))
    compute(kv, a, 8)
    kv.free(a)                                       # blocks 1, 0 cached and free
    b = make_req("fail-b", list(range(8)) + list(range(50, 60)))
    hit = kv.get_computed_blocks(b)
    assert hit == 8
    before = snapshot(kv, b)
    assert not kv.allocate_slots(b, 10, hit)          # needs 2 hit + 3 new blocks; only 4 blocks in all
    assert snapshot(kv, b) == before
    assert kv.allocate_slots(b, 8, hit)               # 2 hit + 2 new fits
    assert b.block_ids[:2] == [0, 1]
    kv.free(b)
    assert_empty(kv)


def test_eviction_reuses_the_tail_of_a_freed_request_first():
    kv = KVCacheManager(3, BS, enable_caching=True, max_model_len=32)
    a = make_req("evict-a", range(12))
    compute(kv, a, 12)
    kv.free(a)                                       # free queue: 2, 1, 0 (all cached)
    c = make_req("evict-c", [77] * 3)
    assert kv.allocate_slots(c, 3) and c.block_ids == [2]
    assert kv.pool.block_hash(2) is None             # stale hash cleared on reuse
    b = make_req("evict-b", range(12))
    assert kv.get_computed_blocks(b) == 8            # the prefix (blocks 0, 1) survived
    kv.free(c)
    kv.free(b)
    assert_empty(kv)


def test_a_remembered_match_is_cut_where_a_block_was_evicted_since():
    kv = KVCacheManager(3, BS, enable_caching=True, max_model_len=32)
    a = make_req("gen-a", range(12))
    compute(kv, a, 12)
    kv.free(a)                                       # free queue: 2, 1, 0 (all cached)
    b = make_req("gen-b", range(13))
    assert kv.get_computed_blocks(b) == 12           # remembered as (block, generation) pairs
    c = make_req("gen-c", [5] * 8)
    assert kv.allocate_slots(c, 8) and c.block_ids == [2, 1]   # evicts the 3rd and then the 2nd block
    assert kv.get_computed_blocks(b) == 4
    assert not kv.allocate_slots(b, 9, 4)            # needs 3 new blocks, none free: refused, no change
    assert b.block_ids == [] and kv.pool.ref_cnt == [0, 1, 1]
    kv.free(c)
    kv.free(b)
    assert_empty(kv)


def test_preempted_request_recovers_its_own_blocks():
    kv = KVCacheManager(6, BS, enable_caching=True, max_model_len=32)
    a = make_req("rec-a", range(9))
    compute(kv, a, 9)
    old = list(a.block_ids)
    kv.free(a)
    a.num_computed_tokens = 0
    assert admit(kv, a) == 8 and a.block_ids[:2] == old[:2]
    kv.free(a)
    assert_empty(kv)


def test_caching_disabled_never_hits():
    kv = KVCacheManager(8, BS, enable_caching=False, max_model_len=32)
    a = make_req("off-a", range(9))
    compute(kv, a, 9)
    assert kv.get_computed_blocks(make_req("off-b", range(9))) == 0
    kv.free(a)
    assert_empty(kv)


def test_check_integrity_catches_leaks_and_stale_state():
    kv = KVCacheManager(4, BS, enable_caching=True, max_model_len=32)
    a = make_req("leak-a", range(5))
    compute(kv, a, 5)
    with pytest.raises(AssertionError, match="refcount 1, but 0 live"):
        kv.check_integrity([])                       # a's blocks are held but a is not live
    a.block_ids.append(a.block_ids[0])
    with pytest.raises(AssertionError, match="refcount 1, but 2|twice"):
        kv.check_integrity([a])
    a.block_ids.pop()
    kv.free(a)
    kv._state["ghost"] = kvm._HashState()
    with pytest.raises(AssertionError, match="ghost"):
        kv.check_integrity([])
    del kv._state["ghost"]
    assert_empty(kv)


def test_allocation_beyond_max_model_len_is_refused():
    kv = KVCacheManager(8, BS, enable_caching=True, max_model_len=8)
    a = make_req("long-a", range(6))
    with pytest.raises(ValueError, match="max_model_len=8"):
        kv.allocate_slots(a, 9)
    assert a.block_ids == []
    assert_empty(kv)
