"""Per-request block tables on top of the BlockPool: prefix matching, all-or-nothing allocation, freeing.

Block table of a request: request.block_ids (the runner reads it). Token t of the request lives in
block_ids[t // block_size] at offset t % block_size.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from minillm.cache.block_pool import BlockPool
from minillm.cache.hashing import ROOT_HASH, BlockHash, hash_block
from minillm.request import Request


@dataclass
class _HashState:
    """Per-request prefix-cache bookkeeping (only when caching is on)."""
    hashes: list[BlockHash] = field(default_factory=list)   # chained hashes of leading full blocks, computed lazily
    num_published: int = 0                                  # leading blocks already offered to the pool's cache
    # Last prefix match of a waiting request as (block id, pool generation). A blocked waiting request is
    # matched every step and again in allocate_slots; re-checking generations costs a compare per block
    # instead of a tuple + lookup + verification (~15x less for long prompts).
    matched: list[tuple[int, int]] = field(default_factory=list)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, max_model_len: int) -> None:
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be an integer >= 1, got {max_model_len!r}")
        self.pool = BlockPool(num_blocks, block_size, enable_caching)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self._state: dict[str, _HashState] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> int:
        """Tokens of the longest verified cached prefix, in whole blocks.

        NOTE: capped at num_tokens - 1, so a full-prompt hit still leaves the last token to compute and the
        request always gets logits for its next token.
        """
        if not self.enable_caching:
            return 0
        return len(self._match(request, (request.num_tokens - 1) // self.block_size)) * self.block_size

    def _match(self, request: Request, max_blocks: int) -> list[int]:
        state = self._get_state(request)
        generation, matched = self.pool.generation, state.matched
        valid = 0
        for block_id, gen in matched:
            if generation[block_id] != gen:
                break                    # evicted since: the match ends here
            valid += 1
        del matched[valid:]
        for i in range(len(matched), max_blocks):
            block_hash, parent, block_tokens = self._block_hash(request, state, i)
            block_id = self.pool.lookup(block_hash, parent, block_tokens)
            if block_id is None:
                break
            matched.append((block_id, generation[block_id]))
        return [block_id for block_id, _ in matched[:max_blocks]]

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's blocks that are full of computed KV (call after every step).

        Publishing as soon as a block fills lets requests that are still prefilling share prefixes; only
        computed blocks are published, so a hit never reads KV that is still being written.
        """
        if not self.enable_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_ids))
        state = self._get_state(request)
        for i in range(state.num_published, num_full):
            block_hash, parent, block_tokens = self._block_hash(request, state, i)
            self.pool.cache_block(request.block_ids[i], block_hash, parent, block_tokens)
        state.num_published = max(state.num_published, num_full)

    def _get_state(self, request: Request) -> _HashState:
        state = self._state.get(request.request_id)
        if state is None:
            state = self._state[request.request_id] = _HashState()
        return state

    def _block_hash(self, request: Request, state: _HashState, i: int) -> tuple[BlockHash, BlockHash, tuple[int, ...]]:
        """(hash, parent hash, token ids) of the request's block i; hashes are computed once, in order."""
        bs = self.block_size
        block_tokens = tuple(request.all_token_ids[i * bs:(i + 1) * bs])
        parent = state.hashes[i - 1] if i else ROOT_HASH
        if i == len(state.hashes):
            state.hashes.append(hash_block(parent, block_tokens))
        return state.hashes[i], parent, block_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (e.g. between benchmark runs); False if any block is still in use."""
        return self.pool.reset_prefix_cache()

    # ---- allocation ---------------------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """Make room for request.num_computed_tokens + num_cached_tokens + num_new_tokens tokens.

        num_cached_tokens > 0 only at admission (empty block table): those tokens come from the prefix hit
        that get_computed_blocks just reported. All or nothing: on False nothing changed at all.
        """
        block_ids = request.block_ids
        total = request.num_computed_tokens + num_cached_tokens + num_new_tokens
        # Fast path, taken by almost every decode: the last block still has room.
        if len(block_ids) * self.block_size >= total:
            return True
        if total > self.max_model_len:
            raise ValueError(f"request {request.request_id}: {total} tokens exceed max_model_len={self.max_model_len}")
        if not num_cached_tokens:
            num_new_blocks = self.blocks_needed(total) - len(block_ids)
            if num_new_blocks > self.pool.num_free_blocks:
                return False
            block_ids.extend(self.pool.allocate(num_new_blocks))
            return True
        return self._allocate_with_hits(request, total, num_cached_tokens)

    def append_blocks(self, requests: list[Request]) -> bool:
        """One more block for each request (decodes whose last block is full), all or nothing: False, with
        nothing allocated, when fewer blocks are free. Same blocks as allocate_slots(r, 1) for each in turn."""
        if len(requests) > self.pool.num_free_blocks:
            return False
        for request, block_id in zip(requests, self.pool.allocate(len(requests))):
            request.block_ids.append(block_id)
        return True

    def _allocate_with_hits(self, request: Request, total: int, num_cached_tokens: int) -> bool:
        """Admission with a prefix hit: share the hit blocks, allocate the rest; all or nothing."""
        if request.block_ids or num_cached_tokens % self.block_size:
            raise ValueError("num_cached_tokens must be whole blocks and only given at admission")
        hits = self._match(request, num_cached_tokens // self.block_size)
        if len(hits) * self.block_size != num_cached_tokens:
            raise ValueError(f"request {request.request_id}: prefix hit changed since get_computed_blocks")
        num_new_blocks = self.blocks_needed(total) - len(hits)
        # Hit blocks that sit in the free queue stop being free once touched.
        free_after_touch = self.pool.num_free_blocks - sum(1 for b in hits if self.pool.ref_cnt[b] == 0)
        if num_new_blocks > free_after_touch:
            return False
        # NOTE: touch before allocate, or allocation could evict the very blocks we hit.
        self.pool.touch(hits)
        request.block_ids.extend(hits)
        request.block_ids.extend(self.pool.allocate(num_new_blocks))
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first into the free queue, so its tail is evicted first."""
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
        self._state.pop(request.request_id, None)

    # ---- invariants ---------------------------------------------------------------------------------------

    def check_integrity(self, live_requests: Iterable[Request]) -> None:
        """Raise AssertionError unless every block's refcount equals the live block tables holding it."""
        live = list(live_requests)
        refs = Counter(b for r in live for b in r.block_ids)
        expected = [refs.get(b, 0) for b in range(self.num_blocks)]
        if len(refs) and max(refs) >= self.num_blocks:
            raise AssertionError(f"a block table holds an id >= num_blocks={self.num_blocks}")
        self.pool.check_integrity(expected)
        for r in live:
            if len(set(r.block_ids)) != len(r.block_ids):
                raise AssertionError(f"request {r.request_id} holds a block twice: {r.block_ids}")
            if len(r.block_ids) * self.block_size < r.num_computed_tokens:
                raise AssertionError(f"request {r.request_id}: {r.num_computed_tokens} computed tokens but only "
                                     f"{len(r.block_ids)} blocks")
        stale = set(self._state) - {r.request_id for r in live}
        if stale:
            raise AssertionError(f"per-request cache state left for finished requests: {sorted(stale)[:8]}")
