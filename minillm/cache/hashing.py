"""Chained content hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash, its own token ids and optional extra keys (e.g. an adapter name), so
equal hashes mean equal whole prefixes, up to a collision.

Why Python's tuple hash and not blake2b/sha256: it costs ~0.3 us per block against ~2-4 us, and blocks are
hashed on the decode hot path (256 decodes at block size 16 fill ~16 blocks per step). Its weaknesses, and
why they are harmless here:
  - 64-bit, not cryptographic: two different prefixes can collide (~2^-64 per pair by chance; deliberately
    crafted token sequences could collide more easily). The block pool stores each cached block's exact
    (parent hash, token ids) and checks them on every hit, so a collision only costs a cache miss, never
    wrong KV. A chain of verified blocks verifies the whole prefix: block i's check includes block i-1's hash,
    which itself came from a verified hit or from this request's own tokens.
  - Per process: int tuples hash the same in every run, but str extra keys are salted per process. Hashes
    are never persisted or sent elsewhere, so only in-process consistency matters.
"""
from __future__ import annotations

from typing import Hashable

BlockHash = int

# Parent of the first block of every sequence.
ROOT_HASH: BlockHash = 0


def hash_block(parent: BlockHash, token_ids: tuple[int, ...], extra_keys: tuple[Hashable, ...] = ()) -> BlockHash:
    """Hash of (parent hash, the block's token ids, extra keys)."""
    if extra_keys:
        return hash((parent, token_ids, extra_keys))
    return hash((parent, token_ids))
