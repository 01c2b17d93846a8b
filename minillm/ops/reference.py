"""fp32 plain-torch references of the CUDA attention kernels (KV write, paged prefill, paged decode).

Deliberately simple: host loops over sequences, explicit gathers through the block table, attention in fp32
with an explicit causal mask. They read only the tokens a sequence owns, so a cache pre-filled with NaN
exposes any kernel that reads an unowned slot. Used by tests and by `minillm check-kernels`.
"""
from __future__ import annotations

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
