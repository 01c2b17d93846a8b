"""fp32 plain-torch references of the CUDA attention kernels (KV write, paged prefill, paged decode).

Deliberately simple: host loops over sequences, explicit gathers through the block table, attention in fp32
with an explicit causal mask. They read only the tokens a sequence owns, so a cache pre-filled with NaN
exposes any kernel that reads an unowned slot. Used by tests and by `minillm check-kernels`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """In place: row t of k/v [T, Hkv, D] goes to flat slot slot_mapping[t] of the caches; -1 is skipped."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping[: k.shape[0]].long()
    keep = slots >= 0
    k_cache.view(-1, num_kv_heads, head_dim)[slots[keep]] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots[keep]] = v[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """First `length` tokens of one sequence from a paged cache: [length, Hkv, D] in fp32."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table.to(cache.device).long()[pos // block_size]
    return cache[blocks, pos % block_size].float()


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int, scale: float) -> torch.Tensor:
    """q [n, Hq, D] at positions first_pos.. attending causally to keys/values [ctx, Hkv, D]; fp32 out."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)      # [Hq, ctx, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("nhd,hcd->hnc", q.float(), k) * scale   # [Hq, n, ctx]
    q_pos = first_pos + torch.arange(q.shape[0], device=q.device)
    k_pos = torch.arange(keys.shape[0], device=q.device)
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hnc,hcd->nhd", scores.softmax(dim=-1), v)


def _as_list(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens, query_start_loc, scale: float) -> torch.Tensor:
    """Causal paged attention for a flat batch: fp32 [T, Hq, D] (rows past query_start_loc[-1] are 0).

    Query i of sequence s sits at position seq_lens[s] - query_len + i: covers full prefill, prefix-cache
    hits, later chunks of a chunked prefill and decode (query_len 1) alike.
    """
    lens, starts = _as_list(seq_lens), _as_list(query_start_loc)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for s, ctx in enumerate(lens):
        lo, hi = starts[s], starts[s + 1]
        if hi <= lo:
            continue
        keys = gather_kv(k_cache, block_tables[s], ctx)
        values = gather_kv(v_cache, block_tables[s], ctx)
        out[lo:hi] = _attend(q[lo:hi], keys, values, ctx - (hi - lo), scale)
    return out


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens, scale: float) -> torch.Tensor:
    """One query row per sequence (row s = sequence s) over its whole context: fp32 [S, Hq, D]."""
    return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, list(range(q.shape[0] + 1)), scale)


@dataclass
class PagedBatch:
    """A random flat batch in the engine's layout, built the way kernel tests should build one (see make_paged_batch)."""
    q: torch.Tensor                 # [T, Hq, D] (a view of one qkv tensor, like the model's split)
    k: torch.Tensor                 # [T, Hkv, D]: this step's new keys (strided view)
    v: torch.Tensor
    k_cache: torch.Tensor           # [num_blocks, block_size, Hkv, D]: earlier tokens set, everything else NaN
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor      # int64 [T]
    block_tables: torch.Tensor      # int32 [S, max_blocks]
    seq_lens: torch.Tensor          # int32 [S]
    query_start_loc: torch.Tensor   # int32 [S + 1]
    seq_lens_list: list[int]
    query_start_list: list[int]

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    def meta(self, num_decodes: int = 0):
        from minillm.attention.metadata import AttentionMetadata

        q_lens = [b - a for a, b in zip(self.query_start_list, self.query_start_list[1:])]
        return AttentionMetadata(
            num_seqs=len(self.seq_lens_list), num_decodes=num_decodes, num_tokens=self.q.shape[0],
            max_query_len=max(q_lens), max_seq_len=max(self.seq_lens_list), slot_mapping=self.slot_mapping,
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, block_tables=self.block_tables,
            block_size=self.block_size, query_start_loc_cpu=list(self.query_start_list),
            seq_lens_cpu=list(self.seq_lens_list))


def make_paged_batch(ctx_lens: list[int], q_lens: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int,
                     block_size: int, dtype: torch.dtype, device="cpu", seed: int = 0,
                     spare_blocks: int = 3) -> PagedBatch:
    """Sequence s has ctx_lens[s] tokens of context of which the last q_lens[s] are this step's queries.

    The test recipe: the cache starts as NaN, the tokens before this step are written with random values, the
    new k/v are returned (not yet in the cache), and blocks are handed out through a random permutation (with
    spare blocks) so that a kernel which assumes adjacent blocks, or reads a slot it does not own, fails.
    """
    if len(ctx_lens) != len(q_lens) or any(not 1 <= q <= c for q, c in zip(q_lens, ctx_lens)):
        raise ValueError("q_lens must pair with ctx_lens and satisfy 1 <= q_len <= ctx_len")
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(ctx_lens), max(blocks_per_seq), dtype=torch.int32)
    cursor = 0
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = perm[cursor:cursor + nb].to(torch.int32)
        cursor += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    slots, starts = [], [0]
    for s, (ctx, ql) in enumerate(zip(ctx_lens, q_lens)):
        pos = torch.arange(ctx)
        flat = block_tables[s, pos // block_size].long() * block_size + pos % block_size
        old = flat[: ctx - ql]
        k_cache.view(-1, num_kv_heads, head_dim)[old] = torch.randn(len(old), num_kv_heads, head_dim, generator=gen).to(dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[old] = torch.randn(len(old), num_kv_heads, head_dim, generator=gen).to(dtype)
        slots.append(flat[ctx - ql:])
        starts.append(starts[-1] + ql)
    qkv = torch.randn(starts[-1], num_q_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    return PagedBatch(q=q, k=k, v=v, k_cache=k_cache.to(device), v_cache=v_cache.to(device),
                      slot_mapping=torch.cat(slots).to(device), block_tables=block_tables.to(device),
                      seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
                      query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                      seq_lens_list=list(ctx_lens), query_start_list=starts)
