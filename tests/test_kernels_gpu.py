"""CUDA attention kernels vs the fp32 references (skipped without a GPU): the check-kernels recipe in small."""
import pytest
import torch

from minillm.diagnostics import paged_meta
from minillm.ops.reference import kv_write_ref, make_paged_batch, paged_attention_ref

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops():
    from minillm.ops import attention_ops
    from minillm.ops.build import load_extension

    load_extension()
    return attention_ops


def _batch(ctx, ql, d=128, hq=16, hkv=8, bs=16, dtype=torch.bfloat16, seed=0):
    b = make_paged_batch(ctx, ql, hq, hkv, d, bs, dtype, "cuda", seed)
    caches = b.k_cache.clone(), b.v_cache.clone()   # before this step's tokens
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens_list, b.query_start_list, d ** -0.5)
    return b, caches, ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs", [16, 32])
def test_kv_write_bit_exact_and_skips_padding(ops, dtype, bs):
    b = make_paged_batch([21, 40], [21, 9], 8, 4, 64, bs, dtype, "cuda", seed=1)
    slots = b.slot_mapping.clone()
    slots[1::3] = -1
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    ops.kv_write(b.k, b.v, kc, vc, slots)
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, slots)
    assert torch.equal(kc.view(torch.int16), b.k_cache.view(torch.int16))
    assert torch.equal(vc.view(torch.int16), b.v_cache.view(torch.int16))


@pytest.mark.parametrize("d,hq,hkv", [(128, 16, 8), (64, 12, 4), (128, 8, 1), (64, 4, 4)])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_ragged_prefix_and_chunks(ops, d, hq, hkv, bs, dtype):
    ctx, ql = [1, 17, 64, 65, 300, 200], [1, 17, 64, 65, 100, 1]   # last two: prefix hit / chunk / single row
    b, _, ref = _batch(ctx, ql, d, hq, hkv, bs, dtype)
    out = torch.full_like(b.q, float("nan"))
    ops.paged_prefill(out, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, d ** -0.5, 100)
    assert (out.float() - ref).abs().max() < (2e-2 if dtype == torch.bfloat16 else 4e-3)


@pytest.mark.parametrize("part", [None, 0, 256, 512, -1, -2, -3, -7, -32])   # -P: P equal partitions per sequence
@pytest.mark.parametrize("d,hq,hkv,bs", [(128, 16, 8, 16), (64, 24, 4, 32), (128, 32, 4, 32), (128, 32, 2, 16)])
def test_decode_v1_and_split_k(ops, part, d, hq, hkv, bs):
    ctx = [1, 15, 16, 257, 1500, 2049]
    b, _, ref = _batch(ctx, [1] * len(ctx), d, hq, hkv, bs)
    out = torch.full_like(b.q, float("nan"))
    ops.paged_decode(out, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, d ** -0.5, max(ctx), part)
    assert (out.float() - ref).abs().max() < 2e-2


@pytest.mark.parametrize("part", [None, 0, -3])
def test_decode_under_pdl_waits_for_the_new_token(ops, part):
    """Launched with programmatic dependent launch, the decode kernel issues its first cached chunks before it
    waits for the kernel before it; the chunk holding the step's new token must wait. Here that kernel (kv_write)
    writes the new token into a slot that holds NaN until then, so a read before the write makes the output NaN.
    Contexts put the new token in a warp's first or second chunk (17, 40), in a later one and in a later
    partition (300, 1500, 2049). Eagerly and as a CUDA graph, every replay from the NaN cache."""
    from minillm.ops.launch import pdl_launches

    ctx = [1, 17, 40, 300, 1500, 2049]
    b, (kc0, vc0), ref = _batch(ctx, [1] * len(ctx))
    kc, vc = kc0.clone(), vc0.clone()
    out = torch.empty_like(b.q)

    def step():
        ops.kv_write(b.k, b.v, kc, vc, b.slot_mapping)
        ops.paged_decode(out, b.q, kc, vc, b.block_tables, b.seq_lens, 128 ** -0.5, max(ctx), part)

    def check(run):
        for _ in range(4):
            kc.copy_(kc0)
            vc.copy_(vc0)
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            assert not out.isnan().any() and (out.float() - ref).abs().max() < 2e-2

    with pdl_launches(True):
        check(step)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    check(graph.replay)


@pytest.mark.parametrize("part", [0, 256, -2])
def test_decode_empty_context_gives_zeros(ops, part):
    b, _, _ = _batch([40, 600], [1, 1])
    lens = b.seq_lens.clone()
    lens[1] = 0
    out = torch.full_like(b.q, float("nan"))
    ops.paged_decode(out, b.q, b.k_cache, b.v_cache, b.block_tables, lens, 128 ** -0.5, 600, part)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and not out[0].isnan().any()


def test_decode_rejects_bad_partition_arguments(ops):
    b, _, _ = _batch([40, 100], [1, 1])
    out = torch.empty_like(b.q)
    for bad in (100, -33, -256):
        with pytest.raises(ValueError, match="partition_size"):
            ops.paged_decode(out, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, 128 ** -0.5, 100, bad)


@pytest.mark.parametrize("mode", ["split", "unified"])
def test_backend_mixed_batch(ops, mode):
    from minillm.attention.cuda_backend import CudaAttentionBackend

    b, (kc, vc), ref = _batch([50, 700, 30, 90], [1, 1, 30, 41])
    out = CudaAttentionBackend(mode).forward(b.q, b.k, b.v, kc, vc, paged_meta(b, num_decodes=2), 128 ** -0.5)
    assert out.dtype == b.q.dtype and (out.float() - ref).abs().max() < 2e-2
    assert torch.equal(kc.view(torch.int16), b.k_cache.view(torch.int16))   # the backend wrote this step's K


def test_decode_graph_capture_replays(ops):
    b, _, ref = _batch([40, 1000], [1, 1])
    out = torch.empty_like(b.q)
    run = lambda: ops.paged_decode(out, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, 128 ** -0.5, 2048)  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert (out.float() - ref).abs().max() < 2e-2
