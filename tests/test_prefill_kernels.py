"""The paged prefill kernels (attention_ops.PREFILL_KERNELS): which one a case runs on, their declarations against
their launchers, and on a GPU each against the fp32 reference over random ragged batches with prefix offsets,
random block tables and NaN-poisoned caches, both head dims, GQA groups 1-16, both dtypes, both block sizes and
prompts up to 8k tokens. The wide and narrow kernels first; the wgmma kernels (sm_90, the engine's there) last."""
import random
import re
import types

import pytest
import torch

from minillm.attention.cuda_backend import CudaAttentionBackend
from minillm.ops import attention_ops as ops
from minillm.ops.build import CUDA_DIR
from minillm.ops.reference import kv_write_ref, make_paged_batch, paged_attention_ref

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def test_wgmma_on_sm90_else_wide_is_chosen_for_native_caches_and_narrow_for_fp8():
    for dt in ("bfloat16", "float16"):
        for d in (64, 128):
            assert ops.prefill_kernel(dt, dt, d, (9, 0)) == "wgmma"
            for cap in ((8, 0), (8, 9), (10, 0), None):
                assert ops.prefill_kernel(dt, dt, d, cap) == "wide"
            for cap in ((9, 0), (8, 0), None):
                assert ops.prefill_kernel(dt, "float8_e4m3fn", d, cap) == "narrow"
                assert ops.prefill_kernel(dt, "float8_e5m2", d, cap) == "narrow"
    assert ops.prefill_kernel("bfloat16", "bfloat16", 96, (9, 0)) == "narrow"   # outside all: the launcher refuses


def test_the_plan_names_the_prefill_kernel_and_the_backend_runs_it(monkeypatch):
    from minillm.ops import build
    from test_plan import CPU, plan

    monkeypatch.setattr(build, "load_extension", lambda: object())   # as tests/test_plan.py: no GPU here

    from test_plan import A100

    native, fp8 = plan(), plan(kv_cache_dtype="fp8")
    assert (native.prefill_kernel, fp8.prefill_kernel, plan(device=A100).prefill_kernel) == ("wgmma", "narrow", "wide")
    assert native.record()["plan"]["prefill_kernel"] == "wgmma" and "prefill=wgmma" in native.describe()
    assert plan(device=CPU, dtype="float32").prefill_kernel is None   # attention on the torch path
    assert CudaAttentionBackend(prefill_kernel="narrow").prefill_kernel == "narrow"
    assert CudaAttentionBackend().prefill_kernel is None   # standalone: chosen per call from the tensors


def test_an_unknown_kernel_or_an_fp8_cache_on_wide_is_refused_before_launch():
    x = torch.zeros(1, 1, 64)
    with pytest.raises(ValueError, match="prefill kernel must be one of"):
        ops.paged_prefill(x, x, x, x, x, x, x, 1.0, 1, kernel="fast")
    with pytest.raises(ValueError, match="not fp8"):
        ops.paged_prefill(x, x, x, x, x, x, x, 1.0, 1, kernel="wide", k_scale=torch.ones(1), v_scale=torch.ones(1))


def test_the_kernels_a_gpu_runs():
    assert ops.prefill_kernels_on((9, 0)) == ("wide", "narrow", "wgmma", "wgmma1")
    assert ops.prefill_kernels_on((8, 0)) == ops.prefill_kernels_on((10, 0)) == ("wide", "narrow")
    assert ops.prefill_kernel("bfloat16", "bfloat16", 128, (9, 0)) == "wgmma"   # wgmma1: its one-warpgroup twin


def _launcher_checks(name: str) -> str:
    """A prefill launcher's source, with the argument check it shares (prefill_tiles.cuh) when it calls it."""
    src = (CUDA_DIR / name).read_text()
    assert "if (!prefill_args_valid(a, max_query_len)) return cudaErrorInvalidValue;" in src
    shared = (CUDA_DIR / "prefill_tiles.cuh").read_text()
    return src + shared[shared.index("inline bool prefill_args_valid"):]


def test_wgmma_declaration_matches_its_launcher():
    src = _launcher_checks("prefill_wgmma.cu")
    cov = ops.PREFILL_WGMMA_COVERAGE
    assert {int(d) for d in re.findall(r"a\.head_dim == (\d+)", src)} == set(cov.head_dims)
    assert "major != 9" in src and (cov.min_capability, cov.max_major) == ((9, 0), 9)
    assert src.count("#if defined(__CUDA_ARCH_FEAT_SM90_ALL)") == 2   # helpers and kernel body: sm_90a only
    assert "if (warpgroups == 2)" in src and "if (warpgroups == 1)" in src                 # wgmma, wgmma1
    assert "(a.block_size & (a.block_size - 1)) == 0" in src and cov.kv_dtypes == ()


def test_wide_declaration_matches_its_launcher():
    src = _launcher_checks("prefill_wide.cu")
    cov = ops.PREFILL_WIDE_COVERAGE
    assert {int(d) for d in re.findall(r"a\.head_dim == (\d+)", src)} == set(cov.head_dims)
    assert "ScalarType::kBFloat16" in src and "ScalarType::kFloat16" in src and set(cov.dtypes) == {"bfloat16",
                                                                                                  "float16"}
    assert "(a.block_size & (a.block_size - 1)) == 0" in src                 # any power-of-two block size
    assert all(b & (b - 1) == 0 for b in cov.block_sizes) and cov.kv_dtypes == ()
    assert "KvQuant" not in src.split("launch_paged_prefill_wide(")[1]      # no fp8 argument at all


# ---- on a GPU ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ext():
    from minillm.ops.build import load_extension

    load_extension()


ENGINE_KERNELS = ("wide", "narrow")   # the kernels every GPU runs; the wgmma ones (sm_90) are tested last, apart


def _check(ctx, ql, d, hq, hkv, bs, dtype, seed, kernels=ENGINE_KERNELS, seq_begin=0, ref_fn=None):
    """Every kernel on one NaN-poisoned batch against the reference; sequences before seq_begin (decode rows in
    the backend's split mode) and the spare output row after the batch must stay untouched (NaN)."""
    b = make_paged_batch(ctx, ql, hq, hkv, d, bs, dtype, "cuda", seed)
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)
    scale = d ** -0.5
    if ref_fn is None:
        ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens_list, b.query_start_list,
                                  scale)
    else:
        ref = ref_fn(b, scale)
    lo = b.query_start_list[seq_begin]
    for kernel in kernels:
        out = torch.full((b.q.shape[0] + 1, hq, d), float("nan"), dtype=dtype, device="cuda")
        ops.paged_prefill(out, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, scale,
                          max(ql[seq_begin:]), seq_begin=seq_begin, num_seqs=len(ctx) - seq_begin, kernel=kernel)
        torch.cuda.synchronize()
        err = (out[lo:-1].float() - ref[lo:]).abs().max().item()
        assert err < TOL[dtype], (kernel, err, ctx, ql)
        assert torch.isnan(out[:lo]).all() and torch.isnan(out[-1]).all(), kernel   # nothing written outside


def _random_batch(rng: random.Random, n: int, max_ctx: int):
    """n sequences: about half whole prompts, the rest chunks over a cached prefix (a prefix hit or a later chunk
    of a chunked prefill), at offsets that mostly fall off the 64-key tile grid."""
    ctx = [rng.randint(1, max_ctx) for _ in range(n)]
    ql = [c if rng.random() < 0.5 else rng.randint(1, c) for c in ctx]
    return ctx, ql


@pytest.mark.gpu
@pytest.mark.parametrize("d,hq,hkv", [(128, 16, 8), (64, 16, 16), (128, 16, 1), (64, 12, 4), (128, 32, 2),
                                      (64, 6, 3)])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_random_ragged_batches_with_prefixes(ext, d, hq, hkv, bs, dtype):
    rng = random.Random(f"{d} {hq} {hkv} {bs} {dtype}")
    for trial in range(2):
        ctx, ql = _random_batch(rng, 6, 700)
        _check(ctx, ql, d, hq, hkv, bs, dtype, seed=trial)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_tile_boundaries(ext, d):
    """Prompt lengths and prefix offsets at and around the 64-key and 128-query tile edges, and a block size of
    64 (both launchers take any power of two)."""
    lens = [1, 2, 63, 64, 65, 127, 128, 129, 255, 256, 257]
    _check(lens, lens, d, 8, 4, 16, torch.bfloat16, seed=1)
    _check([130, 191, 192, 320, 385], [129, 128, 64, 192, 257], d, 8, 2, 32, torch.bfloat16, seed=2)
    _check([500, 77], [300, 77], d, 4, 4, 64, torch.float16, seed=3)


@pytest.mark.gpu
def test_split_mode_offsets_leave_the_decode_rows_alone(ext):
    ctx, ql = [40, 1000, 17, 300, 64], [1, 1, 17, 120, 64]
    _check(ctx, ql, 128, 16, 8, 16, torch.bfloat16, seed=4, seq_begin=2)


@pytest.mark.gpu
@pytest.mark.parametrize("ctx,ql", [(8192, 8192), (8192, 2048), (5000, 1), (4096, 4000)])
def test_long_prompts_and_chunks_over_long_prefixes(ext, ctx, ql):
    from minillm.diagnostics.kernel_check import prefill_ref_chunked

    _check([ctx], [ql], 128, 4, 2, 16, torch.bfloat16, seed=5, ref_fn=prefill_ref_chunked)


@pytest.mark.gpu
def test_wide_kernel_in_a_cuda_graph_replays_exactly(ext):
    b = make_paged_batch([700, 300], [700, 100], 16, 8, 128, 16, torch.bfloat16, "cuda", 6)
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)
    out = torch.empty_like(b.q)

    def run():
        ops.paged_prefill(out, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.1, 700,
                          kernel="wide")

    run()
    eager = out.clone()
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_the_chunked_reference_equals_the_reference():
    """check-kernels' long cases compare with prefill_ref_chunked: it must be paged_attention_ref in pieces."""
    from minillm.diagnostics.kernel_check import prefill_ref_chunked

    b = make_paged_batch([50, 33, 20], [50, 9, 1], 4, 2, 16, 8, torch.float32, "cpu", seed=7)
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens_list, b.query_start_list, 0.3)
    assert torch.allclose(prefill_ref_chunked(b, 0.3, rows=7), ref, atol=1e-6)


# ---- the wgmma kernels (sm_90), last: a fault in them must not hide the others

WGMMA = ("wgmma", "wgmma1")


@pytest.fixture
def sm90(ext):
    if "wgmma" not in ops.prefill_kernels_on(torch.cuda.get_device_capability()):
        pytest.skip("the wgmma prefill kernels need sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", WGMMA)
@pytest.mark.parametrize("d,hq,hkv", [(128, 16, 8), (64, 16, 16), (128, 16, 1), (64, 12, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wgmma_random_ragged_batches_with_prefixes(sm90, kernel, d, hq, hkv, dtype):
    rng = random.Random(f"wgmma {d} {hq} {hkv} {dtype}")
    for trial, bs in enumerate((16, 32)):
        ctx, ql = _random_batch(rng, 6, 700)
        _check(ctx, ql, d, hq, hkv, bs, dtype, seed=trial, kernels=(kernel,))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", WGMMA)
@pytest.mark.parametrize("d", [64, 128])
def test_wgmma_tile_boundaries_and_split_mode(sm90, kernel, d):
    lens = [1, 2, 63, 64, 65, 127, 128, 129, 255, 256, 257, 383]
    _check(lens, lens, d, 8, 4, 16, torch.bfloat16, seed=1, kernels=(kernel,))
    _check([130, 191, 192, 320, 385], [129, 128, 64, 192, 257], d, 8, 2, 32, torch.bfloat16, seed=2,
           kernels=(kernel,))
    _check([40, 1000, 17, 300, 64], [1, 1, 17, 120, 64], d, 16, 8, 16, torch.float16, seed=4, seq_begin=2,
           kernels=(kernel,))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", WGMMA)
@pytest.mark.parametrize("ctx,ql", [(8192, 8192), (8192, 2048)])
def test_wgmma_long_prompts(sm90, kernel, ctx, ql):
    from minillm.diagnostics.kernel_check import prefill_ref_chunked

    _check([ctx], [ql], 128, 4, 2, 16, torch.bfloat16, seed=5, ref_fn=prefill_ref_chunked, kernels=(kernel,))
