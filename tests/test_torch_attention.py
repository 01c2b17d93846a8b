"""TorchAttentionBackend against a dense causal reference on contiguous K/V.

Recipe of docs/architecture.md section 5: the cache starts full of NaN so any read of a slot the sequence does
not own shows up, block tables are random and never adjacent, lengths are ragged (1, block boundaries,
multi-block).
"""
import pytest
import torch

from minillm.attention.torch_backend import TorchAttentionBackend
from minillm.ops.reference import kv_write_ref as write_kv_cache
from tiny_models import alloc_block_tables, build_metadata

D = 8
# (context already cached, new tokens): decode rows first (one new token), then prefill chunks.
SEQS = [(5, 1), (15, 1), (0, 1), (31, 1), (0, 7), (8, 8), (3, 13), (16, 1), (0, 17)]


def dense_reference(q, k, v, scale):
    """q [Tq, Hq, D] are the last Tq positions of a sequence with full k/v [L, Hkv, D]; plain causal attention."""
    tq, hq, _ = q.shape
    length, hkv, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(length - tq, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def _setup(seqs, hq, hkv, block_size, seed=0, num_padding=0, dtype=torch.float32):
    """Caches holding each sequence's context, this step's q/k/v, metadata and the full per-seq K/V."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = alloc_block_tables([c + n for c, n in seqs], block_size, seed=seed)
    k_cache = torch.full((num_blocks, block_size, hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    full_k = [torch.randn(c + n, hkv, D, generator=gen).to(dtype) for c, n in seqs]
    full_v = [torch.randn(c + n, hkv, D, generator=gen).to(dtype) for c, n in seqs]
    ctx_meta = build_metadata([(0, c) for c, _ in seqs if c], block_size, [t for t, (c, _) in zip(tables, seqs) if c])
    write_kv_cache(torch.cat([fk[:c] for fk, (c, _) in zip(full_k, seqs)]),
                   torch.cat([fv[:c] for fv, (c, _) in zip(full_v, seqs)]), k_cache, v_cache, ctx_meta.slot_mapping)
    meta = build_metadata(seqs, block_size, tables, num_padding=num_padding)
    new_k = torch.cat([fk[c:] for fk, (c, _) in zip(full_k, seqs)] + [torch.randn(num_padding, hkv, D, generator=gen).to(dtype)])
    new_v = torch.cat([fv[c:] for fv, (c, _) in zip(full_v, seqs)] + [torch.randn(num_padding, hkv, D, generator=gen).to(dtype)])
    q = torch.randn(meta.num_tokens + num_padding, hq, D, generator=gen).to(dtype)
    return q, new_k, new_v, k_cache, v_cache, meta, full_k, full_v


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (8, 2)])
def test_matches_dense_reference(hq, hkv, block_size):
    q, k, v, k_cache, v_cache, meta, full_k, full_v = _setup(SEQS, hq, hkv, block_size)
    assert meta.num_decodes == 4
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, D ** -0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any(), "an unowned (NaN) cache slot was read"
    qsl = meta.query_start_loc_cpu
    for s in range(len(SEQS)):
        ref = dense_reference(q[qsl[s]:qsl[s + 1]], full_k[s], full_v[s], D ** -0.5)
        torch.testing.assert_close(out[qsl[s]:qsl[s + 1]], ref, atol=1e-5, rtol=1e-5)


def test_cache_holds_exactly_the_owned_slots():
    q, k, v, k_cache, v_cache, meta, full_k, full_v = _setup(SEQS, 4, 2, 4)
    TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, D ** -0.5)
    owned = torch.zeros(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool)
    flat_k, flat_v = k_cache.view(-1, 2, D), v_cache.view(-1, 2, D)
    for s, (c, n) in enumerate(SEQS):
        table = meta.block_tables[s].tolist()
        slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(c + n)])
        owned[slots] = True
        assert torch.equal(flat_k[slots], full_k[s]) and torch.equal(flat_v[slots], full_v[s])
    assert flat_k[~owned].isnan().all() and flat_v[~owned].isnan().all()


def test_padding_rows_are_zero_and_never_written():
    q, k, v, k_cache, v_cache, meta, *_ = _setup([(3, 1), (0, 5)], 4, 2, 4, num_padding=3)
    before = k_cache.isnan().sum()
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, D ** -0.5)
    assert torch.equal(out[meta.num_tokens:], torch.zeros_like(out[meta.num_tokens:]))
    assert before - k_cache.isnan().sum() == 6 * 2 * D   # exactly the 6 real new tokens landed


def test_write_skips_minus_one_slots_without_touching_others():
    cache_k = torch.full((4, 4, 1, 2), float("nan"))
    cache_v = torch.full_like(cache_k, float("nan"))
    k = torch.arange(8.0).view(4, 1, 2)
    slots = torch.tensor([-1, 5, -1, 0])
    write_kv_cache(k, -k, cache_k, cache_v, slots)
    flat = cache_k.view(-1, 1, 2)
    assert torch.equal(flat[5], k[1]) and torch.equal(flat[0], k[3])
    assert torch.equal(cache_v.view(-1, 1, 2)[5], -k[1])
    assert flat.isnan().all(dim=-1).sum() == 14   # the other 14 slots are untouched


def test_write_with_only_skipped_slots_changes_nothing():
    cache_k = torch.randn(2, 4, 1, 2)
    cache_v = torch.randn(2, 4, 1, 2)
    old_k, old_v = cache_k.clone(), cache_v.clone()
    write_kv_cache(torch.ones(3, 1, 2), torch.ones(3, 1, 2), cache_k, cache_v, torch.tensor([-1, -1, -1]))
    assert torch.equal(cache_k, old_k) and torch.equal(cache_v, old_v)


def test_decode_row_equals_same_query_as_prefill_chunk():
    # The batched decode path and the per-sequence prefill path must agree on a one-token query.
    q, k, v, k_cache, v_cache, meta, *_ = _setup([(9, 1)], 4, 2, 4)
    assert meta.num_decodes == 1
    as_decode = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.3)
    meta.num_decodes = 0
    as_prefill = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(as_decode, as_prefill, atol=1e-6, rtol=1e-6)


def test_without_host_lists_falls_back_to_device_tensors():
    q, k, v, k_cache, v_cache, meta, *_ = _setup(SEQS, 4, 2, 4)
    expected = TorchAttentionBackend().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, D ** -0.5)
    meta.query_start_loc_cpu = meta.seq_lens_cpu = None
    got = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, D ** -0.5)
    assert torch.equal(got, expected)


def test_bf16_close_to_fp32_and_keeps_dtype():
    args32 = _setup(SEQS, 4, 2, 4, seed=3)
    args16 = _setup(SEQS, 4, 2, 4, seed=3, dtype=torch.bfloat16)
    out32 = TorchAttentionBackend().forward(*args32[:6], D ** -0.5)
    out16 = TorchAttentionBackend().forward(*args16[:6], D ** -0.5)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), out32, atol=3e-2, rtol=3e-2)
