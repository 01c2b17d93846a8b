"""Physical KV blocks: ids, refcounts, an O(1) LRU free queue and the prefix-cache map (hash -> block).

The pool knows nothing of requests; KVCacheManager owns block tables and decides what to hash.

Free queue: an OrderedDict used as a doubly linked list (O(1) pop from the head, append to the tail, removal
from the middle). Freed blocks go to the tail; allocation takes the head, so the least recently freed block
is reused (and its cached content evicted) first. A free block may still hold a cached prefix: a later hit
takes it back out of the queue ("touch") instead of recomputing its KV.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

from minillm.cache.hashing import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        # NOTE: a block is in the free queue iff its refcount is 0.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Prefix cache. NOTE: _cached[h] == b  iff  _block_hash[b] == h; _block_key[b] holds what verifies a hit.
        self._cached: dict[BlockHash, int] = {}
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._block_key: list[tuple[BlockHash, tuple[int, ...]] | None] = [None] * num_blocks
        # Bumped when a block's cached content is evicted: a (block, generation) pair seen in an earlier lookup
        # is still a verified hit iff the generation is unchanged, so callers can re-check a long match cheaply.
        self.generation = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free queue from head (next to be reused) to tail; for tests and debugging."""
        return list(self._free)

    def cached_blocks(self) -> list[tuple[int, tuple[int, ...]]]:
        """(block id, token ids) of every published block; for tests and debugging."""
        return [(b, self._block_key[b][1]) for b in self._cached.values()]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._block_hash[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the head of the free queue (refcount 1 each); evicts their cached content."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            if self._block_hash[block_id] is not None:
                self._evict(block_id)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks that a request reuses (a prefix hit)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per id, in the given order; blocks reaching 0 join the tail of the free queue.

        NOTE: the only path by which a block becomes free. Cached content stays until the block is reused.
        """
        for block_id in block_ids:
            cnt = self.ref_cnt[block_id] - 1
            if cnt < 0:
                raise AssertionError(f"block {block_id} freed more often than it was referenced")
            self.ref_cnt[block_id] = cnt
            if cnt == 0:
                self._free[block_id] = None

    def lookup(self, block_hash: BlockHash, parent: BlockHash, token_ids: tuple[int, ...]) -> int | None:
        """Block holding exactly this (parent, tokens) content, or None. Verified, never trusted on hash alone."""
        block_id = self._cached.get(block_hash)
        if block_id is None or self._block_key[block_id] != (parent, token_ids):
            return None
        return block_id

    def cache_block(self, block_id: int, block_hash: BlockHash, parent: BlockHash, token_ids: tuple[int, ...]) -> None:
        """Publish a full, computed block under its hash.

        A block that is already published (it came from a hit) is left alone. If another block already holds
        the same content (two requests prefilled the same prefix in one step), this one stays unpublished:
        one block per hash keeps eviction exact.
        """
        if not self.enable_caching or self._block_hash[block_id] is not None or block_hash in self._cached:
            return
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks are cached: got {len(token_ids)} tokens, block_size={self.block_size}")
        self._cached[block_hash] = block_id
        self._block_hash[block_id] = block_hash
        self._block_key[block_id] = (parent, token_ids)

    def _evict(self, block_id: int) -> None:
        # NOTE: a reused block must never be found by its old hash again.
        del self._cached[self._block_hash[block_id]]
        self._block_hash[block_id] = None
        self._block_key[block_id] = None
        self.generation[block_id] += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only allowed when no block is in use (e.g. between benchmark runs)."""
        if len(self._free) != self.num_blocks:
            return False
        for block_id in list(self._cached.values()):
            self._evict(block_id)
        return True

    def check_integrity(self, expected_refs: Sequence[int]) -> None:
        """Raise AssertionError unless refcounts, free queue and cache map agree with expected_refs."""
        if len(expected_refs) != self.num_blocks:
            raise AssertionError(f"expected {self.num_blocks} refcounts, got {len(expected_refs)}")
        for block_id, (have, want) in enumerate(zip(self.ref_cnt, expected_refs)):
            if have != want:
                raise AssertionError(f"block {block_id}: refcount {have}, but {want} live block tables hold it")
        free = set(self._free)
        used = sum(1 for c in self.ref_cnt if c > 0)
        if len(free) + used != self.num_blocks:
            raise AssertionError(f"free ({len(free)}) + used ({used}) != total ({self.num_blocks})")
        wrong = [b for b in free if self.ref_cnt[b] != 0]
        if wrong:
            raise AssertionError(f"blocks {wrong[:8]} are in the free queue with a nonzero refcount")
        for block_hash, block_id in self._cached.items():
            if self._block_hash[block_id] != block_hash or self._block_key[block_id] is None:
                raise AssertionError(f"cache map entry for block {block_id} disagrees with the block's hash")
        if sum(h is not None for h in self._block_hash) != len(self._cached):
            raise AssertionError("a block carries a hash that the cache map does not know")
