"""The one plain-torch implementation of paged attention and the KV write: the reference of the CUDA kernels
(tests, `minillm check-kernels`) and the engine's torch attention backend (minillm/attention/torch_backend.py).

Deliberately simple: explicit gathers through the block table, attention in fp32 with an explicit mask, keys a
query may not see zeroed before they meet a weight, so a cache pre-filled with NaN exposes any kernel that reads
an unowned slot. The cache layout is KVCacheSpec's (minillm/cache/spec.py).

An fp8 cache takes per-KV-head k_scale / v_scale (fp32 [Hkv]): the write quantizes and every read dequantizes to
fp32 (minillm/ops/kv_quant.py), so the attention arithmetic is that of the dequantized cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.ops.kv_quant import dequantize, is_fp8, quantize


def _stored(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x as the cache stores it; fp8 as its bytes (uint8), since not every device indexes float8 tensors."""
    if is_fp8(cache.dtype):
        if scale is None:
            raise ValueError("an fp8 KV cache needs its k_scale / v_scale")
        return quantize(x, scale, cache.dtype).view(torch.uint8)
    return x.to(cache.dtype)


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache viewed as uint8 for indexing (gathers and scatters move bytes); any other cache as it is."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def _typed(rows: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    return rows.view(cache.dtype) if is_fp8(cache.dtype) else rows


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """In place: row t of k/v [T, Hkv, D] goes to flat slot slot_mapping[t] of the caches; -1 is skipped.
    An fp8 cache stores quantize(row, scale) (the scales are ignored for any other cache)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping[: k.shape[0]].long()
    keep = slots >= 0
    _bytes(k_cache).view(-1, num_kv_heads, head_dim)[slots[keep]] = _stored(k[keep], k_cache, k_scale)
    _bytes(v_cache).view(-1, num_kv_heads, head_dim)[slots[keep]] = _stored(v[keep], v_cache, v_scale)


def _read(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return dequantize(cache, scale if is_fp8(cache.dtype) else None)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int,
              scale: torch.Tensor | None = None) -> torch.Tensor:
    """First `length` tokens of one sequence from a paged cache: [length, Hkv, D] in fp32 (dequantized)."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table.to(cache.device).long()[pos // block_size]
    return _read(_typed(_bytes(cache)[blocks, pos % block_size], cache), scale)


def gather_kv_batch(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[B, max_blocks] block ids -> the first `num_tokens` cache rows of each sequence, [B, num_tokens, H, D] in the
    cache dtype (positions past a sequence's own length hold whatever its table points at: mask them)."""
    num_blocks = -(-num_tokens // cache.shape[1])
    blocks = _typed(_bytes(cache)[block_tables[:, :num_blocks].long()], cache)   # [B, nb, block_size, H, D]
    b, nb, bs, h, d = blocks.shape
    return blocks.reshape(b, nb * bs, h, d)[:, :num_tokens]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Tq, Hq, D], k/v [B, L, Hkv, D], mask [B, Tq, L] (True = may attend) -> [B, Tq, Hq, D] in fp32.

    GQA without copying K/V: the Hq query heads are viewed as Hkv groups of Hq/Hkv heads that share one K/V
    head (query head h uses KV head h // group, HF's repeat_kv order). Masked keys are zeroed first so that
    garbage (even NaN) in padded or unowned positions cannot leak through 0 * NaN in the weighted sum.
    """
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    kv_keep = mask.any(dim=1)[:, :, None, None]                   # [B, L, 1, 1]: key used by some query
    kf = torch.where(kv_keep, k, 0).float().permute(0, 2, 1, 3)   # [B, Hkv, L, D]
    vf = torch.where(kv_keep, v, 0).float().permute(0, 2, 1, 3)
    qf = q.float().reshape(b, tq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * tq, d)
    scores = (torch.matmul(qf, kf.transpose(-1, -2)) * scale).view(b, hkv, g, tq, -1)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, hkv, g * tq, -1)
    out = torch.matmul(probs, vf).view(b, hkv, g, tq, d)
    return out.permute(0, 3, 1, 2, 4).reshape(b, tq, hq, d)


def _as_list(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens, query_start_loc, scale: float, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal paged attention for a flat batch: fp32 [T, Hq, D] (rows past query_start_loc[-1] are 0).

    Query i of sequence s sits at position seq_lens[s] - query_len + i: covers full prefill, prefix-cache
    hits, later chunks of a chunked prefill and decode (query_len 1) alike. Reads only the tokens a sequence
    owns, so a cache pre-filled with NaN exposes any kernel that reads an unowned slot.
    """
    lens, starts = _as_list(seq_lens), _as_list(query_start_loc)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for s, ctx in enumerate(lens):
        lo, hi = starts[s], starts[s + 1]
        if hi <= lo:
            continue
        keys = gather_kv(k_cache, block_tables[s], ctx, k_scale)
        values = gather_kv(v_cache, block_tables[s], ctx, v_scale)
        q_pos = torch.arange(ctx - (hi - lo), ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]   # [qlen, ctx]
        out[lo:hi] = attend(q[None, lo:hi], keys[None], values[None], mask[None], scale)[0]
    return out


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens, scale: float, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query row per sequence (row s = sequence s) over its whole context, all rows in one batched call
    padded to the longest context: fp32 [S, Hq, D]."""
    lens = _as_list(seq_lens)
    if not lens:
        return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    max_len = max(lens)
    k = gather_kv_batch(k_cache, block_tables, max_len)
    v = gather_kv_batch(v_cache, block_tables, max_len)
    if is_fp8(k_cache.dtype):
        k, v = _read(k, k_scale), _read(v, v_scale)
    lens_t = torch.tensor(lens, device=q.device)
    mask = torch.arange(max_len, device=q.device)[None, :] < lens_t[:, None]      # [S, L]
    return attend(q[:, None], k, v, mask[:, None], scale)[:, 0]


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
