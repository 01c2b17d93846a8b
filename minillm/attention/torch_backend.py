"""Paged attention in plain PyTorch: the CPU path, the reference for the CUDA kernels, and the
`--attention torch` baseline on a GPU (gather each sequence's K/V through its block table, then attend).

Layout and row order are those of minillm/attention/metadata.py: decode rows (one query each) come first and
are attended together in one batched call padded to the longest decode context; prefill chunks follow and
are attended one sequence at a time. Scores, softmax and the weighted sum run in fp32.
"""
from __future__ import annotations

import torch

from minillm.attention.metadata import AttentionMetadata


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store this step's k/v [T, Hkv, D] at their flat cache slots; rows whose slot is -1 are skipped.

    Skipping without a boolean index keeps this free of device syncs (CUDA-graph safe): each skipped row is
    redirected to the first valid row, so it rewrites that row's slot with that row's value: duplicate indices
    carrying identical values leave the result well defined. With no valid row at all, slot 0 is rewritten
    with its own current content.
    """
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    first_valid = torch.argmax(valid.to(torch.int32))
    src = torch.where(valid, torch.arange(len(slot_mapping), device=slot_mapping.device), first_valid)
    dst = slot_mapping[src].clamp(min=0)
    keep_old = ~valid[src][:, None, None]
    k_flat.index_copy_(0, dst, torch.where(keep_old, k_flat[dst], k[src].to(k_flat.dtype)))
    v_flat.index_copy_(0, dst, torch.where(keep_old, v_flat[dst], v[src].to(v_flat.dtype)))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[B, max_blocks] block ids -> the first `num_tokens` cache rows of each sequence, [B, num_tokens, H, D]."""
    num_blocks = -(-num_tokens // cache.shape[1])
    blocks = cache[block_tables[:, :num_blocks].long()]          # [B, nb, block_size, H, D]
    b, nb, bs, h, d = blocks.shape
    return blocks.reshape(b, nb * bs, h, d)[:, :num_tokens]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Tq, Hq, D], k/v [B, L, Hkv, D], mask [B, Tq, L] (True = may attend) -> [B, Tq, Hq, D] in fp32.

    GQA without copying K/V: the Hq query heads are viewed as Hkv groups of Hq/Hkv heads that share one K/V
    head. Masked keys are zeroed first so that garbage (even NaN) in padded or unowned positions cannot leak
    through 0 * NaN in the weighted sum.
    """
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    kv_keep = mask.any(dim=1)[:, :, None, None]                   # [B, L, 1, 1]: key used by some query
    kf = torch.where(kv_keep, k, 0).float().permute(0, 2, 1, 3)   # [B, Hkv, L, D]
    vf = torch.where(kv_keep, v, 0).float().permute(0, 2, 1, 3)
    # Query head h uses KV head h // g (HF's repeat_kv order); the group rides in the row dim.
    qf = q.float().reshape(b, tq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * tq, d)
    scores = (torch.matmul(qf, kf.transpose(-1, -2)) * scale).view(b, hkv, g, tq, -1)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, hkv, g * tq, -1)
    out = torch.matmul(probs, vf).view(b, hkv, g, tq, d)
    return out.permute(0, 3, 1, 2, 4).reshape(b, tq, hq, d)


class TorchAttentionBackend:
    """forward(q [T,Hq,D], k/v [T,Hkv,D], k_cache, v_cache, meta, scale) -> [T, Hq, D] in q's dtype."""

    name = "torch"

    def fused_kv_write_target(self, *args) -> None:
        """Never fused: forward() writes the cache from k/v (see CudaAttentionBackend.fused_kv_write_target)."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        n = meta.num_tokens
        write_kv_cache(k[:n], v[:n], k_cache, v_cache, meta.slot_mapping[:n])
        # Rows past num_tokens are CUDA-graph padding: they stay zero.
        out = torch.zeros_like(q)
        qsl, seq_lens = _host_lists(meta)
        if meta.num_decodes:
            out[:meta.num_decodes] = self._decode(q, k_cache, v_cache, meta, seq_lens, scale)
        for s in range(meta.num_decodes, meta.num_seqs):
            lo, hi = qsl[s], qsl[s + 1]
            out[lo:hi] = self._prefill(q[lo:hi], k_cache, v_cache, meta.block_tables[s:s + 1], seq_lens[s], scale)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta, seq_lens, scale) -> torch.Tensor:
        nd = meta.num_decodes
        max_len = max(seq_lens[:nd])
        tables = meta.block_tables[:nd]
        k = gather_kv(k_cache, tables, max_len)
        v = gather_kv(v_cache, tables, max_len)
        lens = meta.seq_lens[:nd].to(device=q.device, dtype=torch.long)
        mask = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]      # [nd, L]
        return attend(q[:nd, None], k, v, mask[:, None], scale)[:, 0].to(q.dtype)

    @staticmethod
    def _prefill(q, k_cache, v_cache, table, seq_len: int, scale) -> torch.Tensor:
        qlen = q.shape[0]
        k = gather_kv(k_cache, table, seq_len)
        v = gather_kv(v_cache, table, seq_len)
        # Query i sits at position seq_len - qlen + i and sees keys [0, that position].
        q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]   # [qlen, L]
        return attend(q[None], k, v, mask[None], scale)[0].to(q.dtype)


def _host_lists(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    """Host copies of query_start_loc and seq_lens; falls back to one device->host copy if the runner
    did not provide them."""
    qsl = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc.tolist()
    lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
    return qsl, lens
