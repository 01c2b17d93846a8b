"""Chained content hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash, its own token ids and optional extra keys, so equal hashes mean
equal whole prefixes (up to a blake2b-128 collision, ~2^-64 for any pair). The block pool still verifies a hit
against the stored parent hash and token ids, so even a collision can never serve the wrong KV.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Hashable, Sequence

BlockHash = bytes

# Parent of the first block of every sequence. Fixed length (like every digest) so the hashed byte string
# splits uniquely into parent / length / tokens.
ROOT_HASH: BlockHash = bytes(16)


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple[Hashable, ...] = ()) -> BlockHash:
    """16-byte digest of (parent hash, token ids, extra keys); stable across processes and runs."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        # Extra keys (e.g. an adapter name) separate otherwise identical token blocks; repr is stable for the
        # str/int/tuple values they hold.
        h.update(repr(extra_keys).encode())
    return h.digest()
