"""CPU tests of the attention references, the batch recipe, the decode dispatcher, the build keying and the
CUDA backend's contract (validation, fallback). The kernels themselves are tested in test_kernels_gpu.py."""
import math

import pytest
import torch
import torch.nn.functional as F

from minillm.ops import build
from minillm.ops.attention_ops import CTAS_PER_SM_TARGET, MAX_EQUAL_PARTITIONS, MIN_PARTITIONS, decode_partition_size
from minillm.ops.reference import gather_kv, kv_write_ref, make_paged_batch, paged_attention_ref, paged_decode_ref


def _filled(b):
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)
    return b


def test_batch_recipe_owns_distinct_blocks_and_leaves_nan_elsewhere():
    b = make_paged_batch([5, 33, 16], [5, 2, 16], 4, 2, 8, 16, torch.float32, seed=3)
    used = torch.cat([b.block_tables[0, :1], b.block_tables[1, :3], b.block_tables[2, :1]])
    assert len(set(used.tolist())) == 5                              # no block shared between sequences
    cached = 33 - 2                                                  # only seq 1 has tokens before this step
    assert torch.isnan(b.k_cache).view(-1, 2 * 8).all(dim=1).sum() == b.k_cache.shape[0] * 16 - cached
    _filled(b)
    assert not torch.isnan(gather_kv(b.k_cache, b.block_tables[1], 33)).any()
    with pytest.raises(ValueError, match="q_lens"):
        make_paged_batch([4], [5], 4, 2, 8, 16, torch.float32)


def test_kv_write_ref_skips_padding_and_touches_nothing_else():
    b = make_paged_batch([20, 9], [20, 4], 4, 2, 8, 16, torch.bfloat16, seed=1)
    before = b.k_cache.clone()
    slots = b.slot_mapping.clone()
    slots[0] = -1
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, slots)
    flat, flat_before = b.k_cache.view(-1, 2, 8), before.view(-1, 2, 8)
    assert torch.equal(flat[slots[1:]], b.k[1:])
    changed = ~(flat.view(torch.int16) == flat_before.view(torch.int16)).all(dim=(1, 2))
    assert set(changed.nonzero().flatten().tolist()) <= set(slots[1:].tolist())
    assert torch.isnan(flat[b.slot_mapping[0]]).all()                 # the skipped row stayed NaN


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_paged_reference_matches_sdpa_on_contiguous_kv(hq, hkv):
    ctx, ql = [7, 40, 33], [7, 12, 1]                                # prompt, prefix hit / chunk, decode
    b = _filled(make_paged_batch(ctx, ql, hq, hkv, 16, 16, torch.float32, seed=2))
    out = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.25)
    for s, (c, n) in enumerate(zip(ctx, ql)):
        k = gather_kv(b.k_cache, b.block_tables[s], c).transpose(0, 1)
        v = gather_kv(b.v_cache, b.block_tables[s], c).transpose(0, 1)
        q = b.q[b.query_start_list[s]:b.query_start_list[s + 1]].transpose(0, 1)
        mask = torch.arange(c)[None, :] <= (c - n + torch.arange(n))[:, None]
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0),
                                             attn_mask=mask, scale=0.25).transpose(0, 1)
        torch.testing.assert_close(out[b.query_start_list[s]:b.query_start_list[s + 1]], ref, atol=1e-5, rtol=1e-5)


def test_decode_reference_equals_last_prefill_row():
    b = _filled(make_paged_batch([30, 65], [30, 65], 4, 2, 16, 32, torch.float32, seed=4))
    full = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.3)
    last_rows = torch.tensor([29, 94])
    dec = paged_decode_ref(b.q[last_rows], b.k_cache, b.v_cache, b.block_tables, [30, 65], 0.3)
    torch.testing.assert_close(dec, full[last_rows])


def test_dispatcher_equal_split_k_policy():
    assert decode_partition_size(8, 8, 200, num_sms=132) == 0         # too short to split
    # batches that fill the target unsplit run v1; smaller ones get as many partitions as fit the target
    assert decode_partition_size(512, 8, 1024, num_sms=132) == (0 if MIN_PARTITIONS <= 1 else -MIN_PARTITIONS)
    for batch in (128, 64, 32, 20, 16, 8):
        parts = max(MIN_PARTITIONS, CTAS_PER_SM_TARGET * 132 // (batch * 8))
        assert decode_partition_size(batch, 8, 2048, num_sms=132) == (0 if parts <= 1 else -parts)
    assert decode_partition_size(32, 8, 2048, num_sms=132) == 0        # 256 CTAs: one wave of 2 per SM, unsplit
    assert decode_partition_size(8, 8, 4096, num_sms=132) == -4        # 256 CTAs
    assert decode_partition_size(8, 8, 2048, num_sms=132, ctas_per_sm=8) == -16   # 1056 // 64
    # tiny batches: up to the cap
    assert decode_partition_size(1, 8, 8192, num_sms=132) == -MAX_EQUAL_PARTITIONS
    assert decode_partition_size(1, 8, 8192, num_sms=132, ctas_per_sm=1) == -16
    # the grid depends on the batch size only, never on the context bound (CUDA graphs capture it)
    assert decode_partition_size(4, 8, 4096, num_sms=132) == decode_partition_size(4, 8, 8192, num_sms=132)
    assert -decode_partition_size(64, 8, 2048, num_sms=132) <= parts   # bigger batches never split more


def test_build_key_covers_sources_flags_torch_cuda_and_arch(tmp_path, monkeypatch):
    """A cached library is reused only for the very same sources, flags, torch, CUDA, Python ABI and GPU
    architecture: any of them changing must give a new key (else a stale build loads, or fails to)."""
    (tmp_path / "a.cu").write_text("// a")
    (tmp_path / "x_bindings.cpp").write_text("// b")
    (tmp_path / "helper.cpp").write_text("// not compiled")
    assert [p.name for p in build.extension_sources(tmp_path)] == ["a.cu", "x_bindings.cpp"]
    env = dict(torch_version="2.11.0+cu130", cuda_version="13.0", arch="sm_90")
    key = build.build_key(tmp_path, **env)
    assert build.build_key(tmp_path, **env) == key
    for change in ({"torch_version": "2.12.0+cu130"}, {"cuda_version": "12.8"}, {"arch": "sm_80"}):
        assert build.build_key(tmp_path, **{**env, **change}) != key, change
    monkeypatch.setattr(build.sys.implementation, "cache_tag", "cpython-399")
    assert build.build_key(tmp_path, **env) != key
    monkeypatch.undo()
    monkeypatch.setattr(build, "NVCC_FLAGS", build.NVCC_FLAGS + ["-G"])
    assert build.build_key(tmp_path, **env) != key
    monkeypatch.undo()
    (tmp_path / "common.cuh").write_text("// a header")
    assert build.build_key(tmp_path, **env) != key
    (tmp_path / "a.cu").write_text("// a changed")
    monkeypatch.setenv("MINILLM_EXT_DIR", str(tmp_path / "ext"))
    assert build.build_dir("k").parent == tmp_path / "ext"


def test_build_embeds_ptx_for_newer_gpus():
    gencodes = [build.NVCC_FLAGS[i + 1] for i, f in enumerate(build.NVCC_FLAGS) if f == "-gencode"]
    assert any(g.startswith("arch=compute_") and g.split("code=")[1].startswith("compute_") for g in gencodes)
    assert "arch=compute_90a,code=sm_90a" in gencodes


def test_backend_rejects_bad_mode_and_a_cache_its_kernels_do_not_cover():
    """The CUDA backend makes no per-call fallback: the plan builds it only for covered caches, and
    bind_kv_cache refuses any other once, naming what is not covered."""
    from minillm.attention.cuda_backend import CudaAttentionBackend
    from minillm.cache.spec import KVCacheSpec

    with pytest.raises(ValueError, match="mode"):
        CudaAttentionBackend("fast")
    backend = CudaAttentionBackend("split")
    backend.bind_kv_cache(KVCacheSpec(2, 8, 128, 16, torch.bfloat16))
    for spec, what in ((KVCacheSpec(2, 8, 128, 16, torch.float32), "dtype float32"),
                       (KVCacheSpec(2, 8, 128, 8, torch.bfloat16), "block_size=8"),
                       (KVCacheSpec(2, 8, 96, 16, torch.float16), "head_dim=96")):
        with pytest.raises(ValueError, match=what):
            backend.bind_kv_cache(spec)
