"""FP8 KV-cache kernels against the torch path (skipped without a GPU): the check-kernels fp8 cases, the CUDA
backend against the torch backend on a mixed batch, the engine with an fp8 cache on the CUDA kernels, and the
decode kernel's in-register reads of every fp8 value and of NaN."""
import pytest
import torch

from minillm.diagnostics import paged_meta
from minillm.ops.kv_quant import FP8_DTYPES

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ext():
    from minillm.ops.build import load_extension
    return load_extension()


def test_every_fp8_kernel_case_passes(ext):
    from minillm.diagnostics.kv_quant_check import run_fp8_cases
    rows = run_fp8_cases(quick=False)
    failed = [r for r in rows if not r["passed"]]
    assert rows and not failed, failed[:5]


@pytest.mark.parametrize("mode", ["split", "unified"])
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_cuda_backend_matches_torch_backend_on_a_mixed_batch(ext, kv, mode):
    from minillm.attention.cuda_backend import CudaAttentionBackend
    from minillm.attention.torch_backend import TorchAttentionBackend
    from minillm.cache.spec import KVCacheSpec
    from minillm.ops.kv_quant import dequantize, quantize
    from minillm.ops.reference import make_paged_batch
    ctx, ql = [40, 1000, 17, 300, 64], [1, 1, 17, 120, 64]
    b = make_paged_batch(ctx, ql, 16, 8, 128, 16, torch.bfloat16, "cuda", seed=4)
    spec = KVCacheSpec(1, 8, 128, 16, FP8_DTYPES[kv], scales=(0.01 + 0.02 * torch.rand(1, 2, 8)))
    outs = []
    for backend in (CudaAttentionBackend(mode), TorchAttentionBackend()):
        backend.bind_kv_cache(spec)
        (kc, vc), = spec.allocate(b.k_cache.shape[0], "cuda")
        ks, vs = spec.layer_scales(kc)
        kc.copy_(quantize(b.k_cache, ks, kc.dtype))   # the earlier tokens (NaN where unowned)
        vc.copy_(quantize(b.v_cache, vs, vc.dtype))
        outs.append((backend.forward(b.q, b.k, b.v, kc, vc, paged_meta(b, num_decodes=2), 128 ** -0.5), kc, vc))
    (out, kc, vc), (ref, kr, vr) = outs
    # the new rows were written by the fused-less kv_write_fp8 (k, v given): the same bytes as the reference
    owned = ~torch.isnan(dequantize(kr, spec.scales[0, 0]))
    assert torch.equal(kc.view(torch.uint8)[owned], kr.view(torch.uint8)[owned])
    assert torch.isnan(dequantize(kc, spec.scales[0, 0])[~owned]).all()
    assert (out.float() - ref.float()).abs().max() < 2e-2


def test_engine_with_an_fp8_cache_on_the_kernels(tmp_path):
    from minillm import LLM, SamplingParams
    from tiny_models import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "m", hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=512)
    prompts = [[(7 * i + j) % 512 for j in range(n)] for i, n in enumerate((5, 40, 300, 17))]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs, scales = {}, {}
    for attention in ("cuda", "torch"):
        for calibrate in (True, False):
            llm = LLM(str(path), dtype="bfloat16", kv_cache_dtype="fp8", attention=attention, max_model_len=512,
                      max_num_batched_tokens=64, calculate_kv_scales=calibrate)
            assert llm.engine.runner.kv_spec.quantized
            assert llm.engine.runner.megakernel is None
            if calibrate:
                scales[attention] = llm.engine.runner.kv_spec.scales.float().cpu()   # the start-up calibration's
            else:   # unit scales on both paths, as before the calibration existed
                runs[attention] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            del llm
    # the calibration prefill ran on the CUDA kernels (a bf16 scratch cache) as on the torch path; their scales
    # differ by the kernels' rounding, which is enough to move fp8 bytes, so tokens are compared at unit scales
    assert (scales["cuda"] != 1.0).all()
    torch.testing.assert_close(scales["cuda"], scales["torch"], rtol=5e-2, atol=0)
    assert all(len(t) == 24 for t in runs["cuda"])
    # bf16 kernels and the fp32 reference may split near-ties differently; most tokens agree
    same = sum(a == b for x, y in zip(runs["cuda"], runs["torch"]) for a, b in zip(x, y))
    assert same >= 0.75 * 4 * 24


# ---------------------------------------------------------------- the decode kernel's in-register fp8 reads
# Every finite byte of each format, through each instantiation the engine uses (D 64 / 128, group 16 so rows 8-15
# run too): V read back exactly (one token, so P = 1 and the output is the value times a power-of-two scale),
# K through scores near 1 (one mantissa step off moves the output by ~0.02), and a NaN byte in K or V giving NaN
# where the reference has it (K: with bf16 activations the kernel flags it, kv_fp8.cuh reads it as finite).
HKV, GROUP = 8, 16


def _finite_bytes(cache: torch.dtype) -> torch.Tensor:
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return b[torch.isfinite(b.view(cache).float())]


def _tiny_cache(num_seqs: int, ctx: int, d: int, cache: torch.dtype, seed: int):
    """Caches of NaN bytes with sequence s in block perm[s]; -> (kc, vc, block_tables, seq_lens) on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    nb = num_seqs + 2
    kc = torch.full((nb, 16, HKV, d), 0x7F, dtype=torch.uint8)   # 0x7f is a NaN in e4m3 and in e5m2
    vc = kc.clone()
    bt = torch.randperm(nb, generator=gen)[:num_seqs].to(torch.int32)[:, None]
    lens = torch.full((num_seqs,), ctx, dtype=torch.int32)
    return kc, vc, bt, lens


def _decode(ext_ops, q, kc, vc, bt, lens, cache, ks, vs, part=None):
    out = torch.full_like(q, float("nan"))
    kc, vc = kc.cuda().view(cache), vc.cuda().view(cache)
    ext_ops.paged_decode(out, q, kc, vc, bt.cuda(), lens.cuda(), q.shape[-1] ** -0.5, int(lens.max()), part,
                         k_scale=ks.cuda(), v_scale=vs.cuda())
    from minillm.ops.reference import paged_decode_ref
    ref = paged_decode_ref(q, kc, vc, bt.cuda(), lens.tolist(), q.shape[-1] ** -0.5, ks.cuda(), vs.cuda())
    return out, ref


@pytest.fixture(scope="module")
def ops(ext):
    from minillm.ops import attention_ops
    return attention_ops


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_decode_reads_every_fp8_v_value_exactly(ops, kv, act, d):
    cache = FP8_DTYPES[kv]
    table = _finite_bytes(cache)
    kc, vc, bt, lens = _tiny_cache(2, 1, d, cache, seed=5)
    gen = torch.Generator().manual_seed(6)
    vals = table[torch.randperm(2 * HKV * d, generator=gen) % len(table)].view(2, HKV, d)
    vals.view(-1)[: len(table)] = table                                  # every value at least once
    vc[bt[:, 0].long(), 0] = vals
    kc[bt[:, 0].long(), 0] = 0
    q = torch.zeros(2, HKV * GROUP, d, dtype=act, device="cuda")         # scores 0: P = 1 on the one token
    vs = 2.0 ** -torch.arange(HKV, dtype=torch.float32)                  # powers of two: still exact
    out, ref = _decode(ops, q, kc, vc, bt, lens, cache, torch.ones(HKV), vs)
    assert torch.equal(out, ref.to(act))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_decode_reads_every_fp8_k_value(ops, kv, act, d):
    """Two tokens: K 0 / V 0, then K a row of fp8 values / V 1. Each value has its own query head, one-hot on the
    dim that holds it and sized so that its score is about 1: out = exp(s1) / (1 + exp(s1)) on every dim. The
    values are sorted by magnitude over the kv heads, whose K scale brings each range near 1."""
    cache = FP8_DTYPES[kv]
    table = _finite_bytes(cache)
    mags = table.view(cache).float().abs()
    table = table[torch.argsort(mags, stable=True)]                     # kv head g gets a narrow magnitude range
    kc, vc, bt, lens = _tiny_cache(2, 2, d, cache, seed=7)
    gen = torch.Generator().manual_seed(8)
    blk = bt[:, 0].long()
    kc[blk, 0], vc[blk, 0] = 0, 0
    vc[blk, 1] = torch.tensor([1.0]).to(cache).view(torch.uint8)
    kc[blk, 1] = table[torch.randint(len(table), (2, HKV, d), generator=gen)]
    per_head = -(-len(table) // HKV)                                     # <= 2 * GROUP query heads per kv head
    assert per_head <= 2 * GROUP
    ks = torch.ones(HKV)
    q = torch.zeros(2, HKV * GROUP, d)                                   # heads left without a value: score 0
    sm = d ** -0.5
    for g in range(HKV):
        chunk = table[g * per_head:(g + 1) * per_head]
        vals = chunk.view(cache).float()
        big = vals.abs().max()
        ks[g] = 1.0 / float(big) if big > 0 else 1.0
        for t in range(len(chunk)):
            s, j = divmod(t, GROUP)
            val, dim = float(vals[t]), (g * GROUP + j) % d
            kc[blk[s], 1, g, dim] = chunk[t]
            q[s, g * GROUP + j, dim] = 1.0 / (val * float(ks[g]) * sm) if val != 0 else 1.0
    q = q.to(act).cuda()
    out, ref = _decode(ops, q, kc, vc, bt, lens, cache, ks, torch.ones(HKV))
    assert torch.isfinite(ref).all()
    assert (out.float() - ref).abs().max() < (4e-3 if act == torch.bfloat16 else 1e-3)


@pytest.mark.parametrize("part", [0, -3])
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("where", ["k", "v"])
def test_decode_propagates_an_fp8_nan_like_the_reference(ops, where, kv, act, part):
    from minillm.diagnostics.kv_quant_check import fp8_batch
    from minillm.ops.reference import kv_write_ref
    cache = FP8_DTYPES[kv]
    ctx = [900, 1000, 40]
    b, ks, vs = fp8_batch(ctx, [1] * 3, 16, 8, 128, 16, act, cache, seed=9)
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping, ks, vs)
    target = b.k_cache if where == "k" else b.v_cache
    blk = int(b.block_tables[1, 700 // 16])
    target.view(torch.uint8)[blk, 700 % 16, 3, 17] = 0x7F                 # sequence 1, kv head 3, dim 17
    out = torch.full_like(b.q, float("nan"))
    ops.paged_decode(out, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, 128 ** -0.5, max(ctx), part,
                     k_scale=ks, v_scale=vs)
    from minillm.ops.reference import paged_decode_ref
    ref = paged_decode_ref(b.q, b.k_cache, b.v_cache, b.block_tables, ctx, 128 ** -0.5, ks, vs)
    assert torch.isnan(ref).any() and torch.equal(torch.isnan(out), torch.isnan(ref))
    finite = ~torch.isnan(ref)
    assert (out.float()[finite] - ref[finite]).abs().max() < 2e-2
