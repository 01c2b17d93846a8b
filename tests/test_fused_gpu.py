"""GPU checks of the fused CUDA kernels (torch.ops.minillm.*) against the torch paths of fused_ops.py and the
sampler's numpy reference. Outputs are NaN-poisoned first (the caching allocator hands the poisoned blocks
back to the op), so an element a kernel forgets to write shows. Skipped without CUDA.

The extension is the project build (minillm.ops.build.load_extension), or the library named by
MINILLM_FUSED_EXT_LIB (a build of the fused sources alone, see scripts/device_fused.sh)."""
import os

import numpy as np
import pytest
import torch

from minillm.ops import fused_ops
from minillm.ops.sampling_ops import race_noise, sample_exponential_race_ref

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}
TOKENS = [1, 7, 256, 4096]
DTYPES = [torch.bfloat16, torch.float16]
GQA = [(8, 8), (16, 8), (16, 4), (12, 3), (16, 2), (8, 1)]


@pytest.fixture(scope="module")
def ops():
    lib = os.environ.get("MINILLM_FUSED_EXT_LIB")
    if lib:
        torch.ops.load_library(lib)
    else:
        from minillm.ops.build import load_extension
        load_extension()
    yield torch.ops.minillm   # fused_ops.* with cuda=False (the default) is the torch path: the reference


def _poison(*like: torch.Tensor) -> None:
    """Fill blocks the size of the expected outputs with NaN and free them, so the op's empty() reuses them."""
    blocks = [torch.full_like(t, float("nan")) for t in like]
    del blocks


def _check(out: torch.Tensor, ref: torch.Tensor, cancels: bool = False) -> None:
    """cancels: the output is a difference of rounded intermediates (RoPE after the q/k norm), where one ulp
    of an intermediate (the kernel's fp32 sum runs in another order) is not small next to the result; the
    absolute tolerance then grows to two ulps of the largest output."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "unwritten (NaN) elements in the kernel output"
    tol = TOL[ref.dtype]
    atol = max(tol, 2 * torch.finfo(ref.dtype).eps * ref.abs().max().item()) if cancels else tol
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=tol)
    if ref.dtype != torch.float32:
        # The kernels round like the torch path; only the fp32 reduction order may move a value by one ulp,
        # which a half-precision output rarely shows (in fp32 it shows everywhere, so no count there).
        assert (out == ref).float().mean().item() >= 0.99


def _randn(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("hidden", [1024, 896, 128])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm(ops, dtype, hidden, tokens):
    g = torch.Generator("cuda").manual_seed(tokens * hidden)
    x = _randn(tokens, hidden, dtype=dtype, gen=g, scale=3.0)
    w = _randn(hidden, dtype=dtype, gen=g).abs() + 0.5
    ref = fused_ops.rms_norm(x, w, 1e-6)
    _poison(ref)
    _check(ops.rms_norm(x, w, 1e-6), ref)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("hidden", [1024, 896, 128])
@pytest.mark.parametrize("tokens", TOKENS)
def test_fused_add_rms_norm(ops, dtype, hidden, tokens):
    g = torch.Generator("cuda").manual_seed(tokens + hidden)
    x, res = _randn(tokens, hidden, dtype=dtype, gen=g), _randn(tokens, hidden, dtype=dtype, gen=g, scale=4.0)
    w = _randn(hidden, dtype=dtype, gen=g).abs() + 0.5
    ref_normed, ref_sum = fused_ops.fused_add_rms_norm(x, res, w, 1e-6)
    _poison(ref_normed, ref_sum)
    normed, s = ops.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(s, ref_sum)  # one rounding of x + residual, same as torch
    _check(normed, ref_normed)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("inter", [3072, 896, 128])
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul(ops, dtype, inter, tokens):
    g = torch.Generator("cuda").manual_seed(tokens * 3 + inter)
    gate_up = _randn(tokens, 2 * inter, dtype=dtype, gen=g, scale=3.0)
    ref = fused_ops.silu_and_mul(gate_up)
    _poison(ref)
    _check(ops.silu_and_mul(gate_up), ref)


def _rope_inputs(tokens, hq, hkv, d, dtype, with_norm, seed):
    g = torch.Generator("cuda").manual_seed(seed)
    qkv = _randn(tokens, (hq + 2 * hkv) * d, dtype=dtype, gen=g, scale=2.0)
    positions = torch.randint(0, 8192, (tokens,), generator=g, device="cuda")
    cache = fused_ops.rope_cos_sin_cache(d, 8192, 1e6, device="cuda")
    weights = ((_randn(d, dtype=dtype, gen=g).abs() + 0.5, _randn(d, dtype=dtype, gen=g).abs() + 0.5)
               if with_norm else (None, None))
    return qkv, positions, cache, weights


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_norm_rope(ops, dtype, head_dim, hq, hkv, tokens, with_norm):
    qkv, positions, cache, (qw, kw) = _rope_inputs(tokens, hq, hkv, head_dim, dtype, with_norm, tokens + hq)
    refs = fused_ops.qk_norm_rope(qkv, positions, cache, hq, hkv, head_dim, qw, kw, 1e-6)
    refs = [r.contiguous() for r in refs]
    _poison(*refs)
    outs = ops.qk_norm_rope(qkv, positions, cache, hq, hkv, head_dim, qw, kw, 1e-6)
    for out, ref in zip(outs, refs):
        _check(out, ref, cancels=with_norm)
    assert torch.equal(outs[2], refs[2])  # v is a plain copy


def test_unaligned_and_strided_inputs_take_the_scalar_path(ops):
    """Views that start one element off a 16-byte boundary, and rows further apart than their length."""
    g = torch.Generator("cuda").manual_seed(7)
    big = _randn(33, 2 * 1024 + 8, dtype=torch.bfloat16, gen=g)
    x, res = big[:, 1:897], big[:, 1000:1896]
    w = _randn(896, dtype=torch.bfloat16, gen=g).abs() + 0.5
    _check(ops.rms_norm(x, w, 1e-6), fused_ops.rms_norm(x, w, 1e-6))
    for out, ref in zip(ops.fused_add_rms_norm(x, res, w, 1e-6), fused_ops.fused_add_rms_norm(x, res, w, 1e-6)):
        _check(out, ref)
    _check(ops.silu_and_mul(big[:, 1:2049]), fused_ops.silu_and_mul(big[:, 1:2049]))
    qkv, positions, cache, (qw, kw) = _rope_inputs(33, 4, 2, 64, torch.bfloat16, True, 8)
    wide = torch.zeros(33, qkv.shape[1] + 1, dtype=qkv.dtype, device="cuda")
    wide[:, 1:] = qkv
    outs = ops.qk_norm_rope(wide[:, 1:], positions, cache, 4, 2, 64, qw, kw, 1e-6)
    for out, ref in zip(outs, fused_ops.qk_norm_rope(qkv, positions, cache, 4, 2, 64, qw, kw, 1e-6)):
        _check(out, ref.contiguous(), cancels=True)


def test_out_of_range_position_gives_nan(ops):
    qkv, positions, cache, (qw, kw) = _rope_inputs(4, 2, 1, 64, torch.bfloat16, True, 9)
    positions[2] = cache.shape[0]
    q, k, v = ops.qk_norm_rope(qkv, positions, cache, 2, 1, 64, qw, kw, 1e-6)
    assert q[2].isnan().all() and k[2].isnan().all() and not v[2].isnan().any()
    assert not q[[0, 1, 3]].isnan().any()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that NaN compares equal to the same NaN."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _cache_case(tokens, hkv, d, dtype, seed, block_size=16, misalign=False):
    """NaN-filled caches with room for twice the tokens, and a slot_mapping of distinct random slots with every
    third token skipped (-1) plus four entries past the tokens that name free slots (never to be written).
    misalign: the caches start one element past a 16-byte boundary (the kernel must take scalar accesses)."""
    g = torch.Generator("cuda").manual_seed(seed)
    shape = ((2 * tokens + 4) // block_size + 1, block_size, hkv, d)
    n = shape[0] * block_size
    k_cache, v_cache = (torch.full((n * hkv * d + 1,), float("nan"), dtype=dtype, device="cuda")[int(misalign):]
                        [:n * hkv * d].view(shape) for _ in range(2))
    slots = torch.randperm(n, generator=g, device="cuda")[:tokens + 4]
    slots[:tokens:3] = -1
    return k_cache, v_cache, slots


def _unfused_cache_write(ops, k, v, k_cache, v_cache, slots):
    """The unfused path's KV write: the kv_write kernel where it is built (absent from the fused-only library of
    scripts/device_fused.sh) and takes the dtype (bf16/fp16), else kv_write_ref, the same plain copy (checked
    bit for bit against the kernel in test_kernels_gpu.py)."""
    from minillm.ops.reference import kv_write_ref

    if k.dtype != torch.float32 and hasattr(ops, "kv_write"):
        ops.kv_write(k, v, k_cache, v_cache, slots)
    else:
        kv_write_ref(k, v, k_cache, v_cache, slots)


def _check_cache_write(ops, qkv, positions, cos_sin, hq, hkv, d, qw, kw, misalign=False):
    """qk_norm_rope_cache against qk_norm_rope + the KV write on the same inputs (so the same access path):
    the same q, the same cache bits, and every slot but those of the stored tokens still NaN."""
    tokens = qkv.shape[0]
    k_cache, v_cache, slots = _cache_case(tokens, hkv, d, qkv.dtype, tokens + d, misalign=misalign)
    q_ref, k, v = ops.qk_norm_rope(qkv, positions, cos_sin, hq, hkv, d, qw, kw, 1e-6)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    _unfused_cache_write(ops, k, v, k_ref, v_ref, slots)
    _poison(q_ref)
    q = ops.qk_norm_rope_cache(qkv, positions, cos_sin, hq, hkv, d, qw, kw, 1e-6, k_cache, v_cache, slots)
    assert torch.equal(q, q_ref)
    assert torch.equal(_bits(k_cache), _bits(k_ref)) and torch.equal(_bits(v_cache), _bits(v_ref))
    stored = slots[:tokens][slots[:tokens] >= 0]
    untouched = torch.ones(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool, device="cuda")
    untouched[stored] = False
    for cache in (k_cache, v_cache):
        rows = cache.view(-1, hkv, d)
        assert rows[untouched].isnan().all() and not rows[stored].isnan().any()


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(16, 8), (12, 3), (8, 1)])
@pytest.mark.parametrize("tokens", [1, 7, 256])
@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_norm_rope_cache_write_is_bit_identical_to_kv_write(ops, dtype, head_dim, hq, hkv, tokens, with_norm):
    """tokens=1: the only token is skipped, so nothing is stored but q."""
    qkv, positions, cos_sin, (qw, kw) = _rope_inputs(tokens, hq, hkv, head_dim, dtype, with_norm, tokens + hq)
    _check_cache_write(ops, qkv, positions, cos_sin, hq, hkv, head_dim, qw, kw)


@pytest.mark.parametrize("where", ["qkv", "cache"])
def test_qk_norm_rope_cache_write_scalar_path(ops, where):
    """A qkv view, or caches, one element off a 16-byte boundary: scalar accesses, the same bits. Misaligned
    caches alone put only the fused call on the scalar path, so that case runs without the q/k norm, whose sum
    of squares is the one thing the two paths add up in another order."""
    qkv, positions, cos_sin, (qw, kw) = _rope_inputs(33, 4, 2, 64, torch.bfloat16, where == "qkv", 12)
    if where == "qkv":
        wide = torch.zeros(33, qkv.shape[1] + 1, dtype=qkv.dtype, device="cuda")
        wide[:, 1:] = qkv
        qkv = wide[:, 1:]
    _check_cache_write(ops, qkv, positions, cos_sin, 4, 2, 64, qw, kw, misalign=where == "cache")


def test_qk_norm_rope_cache_bad_arguments_raise_value_error(ops):
    qkv, positions, cos_sin, (qw, kw) = _rope_inputs(4, 2, 1, 64, torch.bfloat16, True, 10)
    k_cache, v_cache, slots = _cache_case(4, 1, 64, torch.bfloat16, 10)
    good = dict(k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    for bad, field in [(dict(k_cache=k_cache.half()), "k_cache"), (dict(k_cache=k_cache.cpu()), "k_cache"),
                       (dict(v_cache=v_cache.expand(-1, -1, 2, -1)), "v_cache"),           # 2 kv heads, not 1
                       (dict(v_cache=v_cache.transpose(0, 1)), "v_cache"),                 # not contiguous
                       (dict(v_cache=v_cache.view(-1)[:8 * 64].view(1, 8, 1, 64)), "v_cache"),  # other shape
                       (dict(slot_mapping=slots.int()), "slot_mapping"),
                       (dict(slot_mapping=slots[:3]), "slot_mapping")]:
        a = good | bad
        with pytest.raises(ValueError, match=field):
            ops.qk_norm_rope_cache(qkv, positions, cos_sin, 2, 1, 64, qw, kw, 1e-6, a["k_cache"], a["v_cache"],
                                   a["slot_mapping"])


def test_cuda_backend_with_fused_kv_write_matches_unfused(ops, monkeypatch):
    """Attention through the CUDA backend with the KV write fused into qk_norm_rope: the caches of the unfused
    path bit for bit, and the same output (the attention kernels read the same caches)."""
    if not hasattr(ops, "paged_prefill"):
        pytest.skip("the attention kernels are not in this build (fused-only library)")
    from minillm.attention.cuda_backend import CudaAttentionBackend
    from minillm.diagnostics import paged_meta
    from minillm.ops.reference import make_paged_batch

    hq, hkv, d = 16, 8, 128
    b = make_paged_batch([37, 300, 20, 5], [1, 1, 20, 3], hq, hkv, d, 16, torch.bfloat16, "cuda", seed=3)
    meta = paged_meta(b, num_decodes=2)
    qkv, positions, cos_sin, (qw, kw) = _rope_inputs(b.q.shape[0], hq, hkv, d, torch.bfloat16, True, 11)
    args = (qkv, positions, cos_sin, hq, hkv, d, qw, kw, 1e-6)
    backend = CudaAttentionBackend(fuse_kv_write=True)
    k_ref, v_ref = b.k_cache.clone(), b.v_cache.clone()
    expected = backend.forward(*fused_ops.qk_norm_rope(*args, cuda=True), k_ref, v_ref, meta, d ** -0.5)

    target = backend.fused_kv_write_target(qkv, hq, d, b.k_cache, b.v_cache, meta)
    assert target is not None
    q, k, v = fused_ops.qk_norm_rope(*args, kv_cache_out=target, cuda=True)
    assert k is None and v is None
    out = backend.forward(q, k, v, b.k_cache, b.v_cache, meta, d ** -0.5)
    assert torch.equal(_bits(b.k_cache), _bits(k_ref)) and torch.equal(_bits(b.v_cache), _bits(v_ref))
    assert torch.equal(out, expected)
    # (fp32 and other uncovered caches never get a fusing backend: the plan decides, tests/test_plan.py)
    assert CudaAttentionBackend(fuse_kv_write=False).fused_kv_write_target(qkv, hq, d, b.k_cache, b.v_cache,
                                                                           meta) is None


@pytest.mark.parametrize("vocab,pad,spread", [(151936, 0, 4), (1001, 3, 4), (151936, 0, 40), (1001, 3, 40)])
def test_sampler_matches_reference(ops, vocab, pad, spread):
    """Same Philox words as the numpy reference: the same token except at float-rounding near-ties.
    pad > 0 makes rows unaligned and further apart than vocab (the scalar-load path). A wide spread of logits
    lets the kernel prune almost every column (and whole Philox groups) without computing its noise exactly."""
    g = torch.Generator("cuda").manual_seed(vocab + spread)
    rows = 48
    logits = torch.randn(rows, vocab + pad, generator=g, device="cuda")[:, pad // 2:pad // 2 + vocab] * spread
    inv_t = torch.rand(rows, generator=g, device="cuda") * 3
    inv_t[::4] = 0
    out = ops.sample_exponential_race(logits, inv_t, 1234, 77)
    ref = sample_exponential_race_ref(logits, inv_t, 1234, 77)
    greedy = inv_t == 0
    assert torch.equal(out[greedy], logits.argmax(dim=1)[greedy])
    scores = logits.cpu().numpy() * inv_t.cpu().numpy()[:, None] + race_noise(range(rows), vocab, 1234, 77)
    for r in np.flatnonzero((out != ref).cpu().numpy()):
        a, b = scores[r, out[r].item()], scores[r, ref[r].item()]
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"row {r}: kernel and reference disagree beyond a tie"
    assert (out == ref).float().mean().item() >= 0.95


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,pad", [(151936, 0), (4096, 16), (1001, 0), (1001, 3), (4100, 0), (4096, 8)])
def test_sampler_half_precision_logits_pick_the_fp32_tokens(ops, dtype, vocab, pad):
    """bf16 / fp16 logits read directly give exactly the tokens the kernel gives for the same values in fp32
    (widening is exact, the fp32 score of each column is the same), hence the reference's too, up to its
    float near-ties (test_sampler_matches_reference). Loads: (151936, 0) 16-byte vectors of 8 columns;
    (4096, 16) the same on rows 4112 apart; the others scalar: odd vocab (1001), unaligned rows (1001, 3),
    vocab a multiple of 4 but not 8 (4100), rows starting 8 bytes off a 16-byte boundary (4096, 8)."""
    g = torch.Generator("cuda").manual_seed(vocab + pad)
    rows = 40
    base = torch.randn(rows, vocab + pad, generator=g, device="cuda") * 4
    logits = base.to(dtype)[:, pad // 2:pad // 2 + vocab]
    wide = logits.float()
    inv_t = torch.rand(rows, generator=g, device="cuda") * 3
    inv_t[::5] = 0
    greedy = inv_t == 0
    for offset in (0, 77, 2**40 + 3):
        out = ops.sample_exponential_race(logits, inv_t, 99, offset)
        assert torch.equal(out, ops.sample_exponential_race(wide, inv_t, 99, offset))
        assert torch.equal(out[greedy], wide.argmax(dim=1)[greedy])
        ref = sample_exponential_race_ref(logits, inv_t, 99, offset)   # the reference widens to fp32 itself
        scores = wide.cpu().numpy() * inv_t.cpu().numpy()[:, None] + race_noise(range(rows), vocab, 99, offset)
        for r in np.flatnonzero((out != ref).cpu().numpy()):
            a, b = scores[r, out[r].item()], scores[r, ref[r].item()]
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"row {r}: kernel and reference disagree beyond a tie"


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampler_half_precision_ties_and_specials(ops, dtype):
    """Columns equal in half precision (a tie on a greedy row goes to the lowest index), -inf and NaN, as the
    fp32 copy of the same logits gives them."""
    vocab = 4096
    logits = torch.zeros(6, vocab, device="cuda", dtype=dtype)
    logits[0, [17, 4000]] = 9.0                    # greedy tie: column 17
    logits[1, :] = float("-inf")
    logits[1, 4095] = 0.0                          # the only finite column wins at any temperature
    logits[2, 123] = float("nan")                  # NaN counts as largest, as in torch.argmax
    logits[3, 8:16] = 5.0                          # one 16-byte vector of equal values
    inv_t = torch.tensor([0.0, 1.0, 0.0, 0.0, 2.0, 0.5], device="cuda")
    out = ops.sample_exponential_race(logits, inv_t, 1, 2)
    assert out.tolist()[:4] == [17, 4095, 123, 8]
    assert torch.equal(out, ops.sample_exponential_race(logits.float(), inv_t, 1, 2))


def _chunk_cols(logits: torch.Tensor) -> int:
    """Columns per load chunk of the sampler kernel for these logits: 16-byte vectors when the vocab, the row
    stride and the start allow them, else groups of 4 scalar loads (sampling.cu, launch_race)."""
    vec = 16 // logits.element_size()
    aligned = logits.shape[1] % vec == 0 and logits.stride(0) % vec == 0 and logits.data_ptr() % 16 == 0
    return vec if aligned else 4


def _split_starts(logits: torch.Tensor, splits: int) -> list[int]:
    """First column of each CTA's range when a row is split `splits` ways (the launcher's ranges)."""
    cols = _chunk_cols(logits)
    chunks = -(-logits.shape[1] // cols)
    per = -(-chunks // splits)
    return [s * per * cols for s in range(-(-chunks // per))]


def _poison_bytes(nbytes: int) -> None:
    """Free a block of 0x5A bytes, so that the op's next allocations (its workspace of partial results and
    tickets) likely reuse it: tickets that started anywhere but zero would lose rows."""
    block = torch.full((nbytes,), 0x5A, dtype=torch.uint8, device="cuda")
    del block


def _assert_matches_reference(out, logits, inv_t, seed, offset):
    """Greedy rows: the reference's argmax exactly. Sampled rows: the reference's token, or one whose score
    ties it to within float rounding (numpy's logarithms against CUDA's, as in test_sampler_matches_reference)."""
    rows, vocab = logits.shape
    ref = sample_exponential_race_ref(logits, inv_t, seed, offset)
    greedy = inv_t == 0
    assert torch.equal(out[greedy], ref[greedy])
    wide = logits.float().cpu().numpy()
    scores = wide * inv_t.cpu().numpy()[:, None] + race_noise(range(rows), vocab, seed, offset)
    for r in np.flatnonzero((out != ref).cpu().numpy()):
        a, b = scores[r, out[r].item()], scores[r, ref[r].item()]
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"row {r}: kernel and reference disagree beyond a tie"


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("vocab", [151936, 50257, 1001])
@pytest.mark.parametrize("rows", [1, 3, 16, 200])
def test_sampler_split_rows_give_the_one_cta_tokens(ops, dtype, vocab, rows):
    """Rows split over several CTAs (forced: 2, 3, 7, 64 per row; and the op's own choice, several per row on a
    GPU with many more SMs than rows) give bit for bit the tokens of one CTA per row (splits=1, the kernel as it
    was), greedy and sampled rows mixed, at two offsets. 151936: 16-byte loads; 50257 and 1001: odd, the scalar
    path. Each call first frees a poisoned block, so a workspace whose tickets did not start at zero would show.
    The reference (numpy) agrees up to float near-ties; it is run for the small batches only (the 200-row ones
    cost seconds of numpy and test nothing the splits=1 comparison does not)."""
    g = torch.Generator("cuda").manual_seed(rows * 7 + vocab)
    logits = (torch.randn(rows, vocab, generator=g, device="cuda") * 4).to(dtype)
    for offset, greedy_from in ((5, 0), (2**40 + 9, 1)):
        inv_t = torch.rand(rows, generator=g, device="cuda") * 2 + 0.25
        inv_t[greedy_from::3] = 0         # rows=1: greedy at the first offset, sampled at the second
        one = ops.sample_exponential_race(logits, inv_t, 42, offset, 1)
        greedy = inv_t == 0
        assert torch.equal(one[greedy], logits.float().argmax(dim=1)[greedy])
        for splits in (0, 2, 3, 7, 64):
            _poison_bytes(rows * (8 * 64 + 4))
            out = ops.sample_exponential_race(logits, inv_t, 42, offset, splits)
            assert torch.equal(out, one), f"splits={splits}: rows {torch.nonzero(out != one).flatten().tolist()}"
        if rows <= 16:
            _assert_matches_reference(one, logits, inv_t, 42, offset)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("vocab", [151936, 50257])
@pytest.mark.parametrize("splits", [3, 4, 37])
def test_sampler_split_ties_and_nan_across_ranges(ops, dtype, vocab, splits):
    """Equal maxima in two CTAs' ranges (at the first column of a range, on both sides of a range boundary) go
    to the lowest column, NaN in one range beats everything, two NaN go to the lowest: whatever CTA finishes
    first. Greedy rows tie on logits; sampled rows tie on +inf logits (score +inf whatever the noise)."""
    logits = torch.zeros(8, vocab, device="cuda", dtype=dtype)
    starts = _split_starts(logits, splits)
    assert len(starts) == splits
    lo, hi = starts[1], starts[-1]           # first columns of the second and of the last range
    nan, inf = float("nan"), float("inf")
    logits[0, [hi, lo]] = 7.0                # greedy: ranges 1 and last -> lo
    logits[1, [lo - 1, lo]] = 7.0            # greedy: last column of range 0, first of range 1 -> lo - 1
    logits[2, [vocab - 1, hi + 5]] = 7.0     # greedy: two columns of the last range, lowest wins -> hi + 5
    logits[3, [hi, lo + 2]] = inf            # sampled: +inf in two ranges -> lo + 2
    logits[4, lo + 1] = nan                  # sampled: NaN in one range beats a huge logit elsewhere
    logits[4, 0] = 1e4
    logits[5, [hi, lo + 7]] = nan            # greedy: two NaN -> lo + 7
    logits[6, 0] = inf                       # sampled: NaN over +inf
    logits[6, hi + 1] = nan
    logits[7, :] = -inf                      # sampled: every score -inf -> column 0
    inv_t = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.7, 0.0, 1.3, 2.0], device="cuda")
    expected = [lo, lo - 1, hi + 5, lo + 2, lo + 1, lo + 7, hi + 1, 0]
    for s in (splits, 1, 0):
        _poison_bytes(8 * (8 * splits + 4))
        out = ops.sample_exponential_race(logits, inv_t, 3, 4, s)
        assert out.tolist() == expected, f"splits={s}"
    assert ops.sample_exponential_race(logits.float(), inv_t, 3, 4, splits).tolist() == expected
    assert torch.equal(logits.float().argmax(dim=1)[inv_t == 0], torch.tensor(expected, device="cuda")[inv_t == 0])


@pytest.mark.parametrize("splits", [0, 5])
def test_sampler_split_rows_replay_in_a_cuda_graph(ops, splits):
    """Captured once, replayed with new logits: each replay gives the eager tokens, so the workspace (the
    graph's own block) starts every replay with zero tickets. splits=0: the op's own choice (several per row for
    3 rows on any GPU of 3 SMs or more)."""
    rows, vocab = 3, 151936
    g = torch.Generator("cuda").manual_seed(splits)
    static_logits = torch.randn(rows, vocab, generator=g, device="cuda").bfloat16()
    inv_t = torch.tensor([0.0, 1.0, 0.6], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):            # warm up off the capturing stream, as torch.cuda.graphs advises
        for _ in range(2):
            ops.sample_exponential_race(static_logits, inv_t, 9, 17, splits)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ops.sample_exponential_race(static_logits, inv_t, 9, 17, splits)
    for scale in (3.0, 0.5, 3.0):
        fresh = (torch.randn(rows, vocab, generator=g, device="cuda") * scale).bfloat16()
        static_logits.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, ops.sample_exponential_race(fresh, inv_t, 9, 17, 1))
        assert torch.equal(static_out, ops.sample_exponential_race(fresh, inv_t, 9, 17, splits))
        assert static_out[0].item() == fresh[0].float().argmax().item()


def test_sampler_split_bad_arguments_raise_value_error(ops):
    logits, inv_t = torch.zeros(2, 64, device="cuda"), torch.ones(2, device="cuda")
    for splits in (-1, 1025):
        with pytest.raises(ValueError, match="splits"):
            ops.sample_exponential_race(logits, inv_t, 0, 0, splits)
    assert ops.sample_exponential_race(logits, inv_t, 0, 0, 1024).shape == (2,)   # capped at the 16 chunks


def _record_kernel_dtypes(monkeypatch) -> list:
    """Wraps the sampling op so that each call's logits dtype is appended to the returned list."""
    from minillm.ops import sampling_ops

    kernel, seen = sampling_ops.sample_exponential_race, []

    def recording(logits, *args, **kw):
        seen.append(logits.dtype)
        return kernel(logits, *args, **kw)

    monkeypatch.setattr(sampling_ops, "sample_exponential_race", recording)
    return seen


def test_sampler_all_greedy_batch_runs_the_kernel_on_bf16_logits(ops, monkeypatch):
    """With the CUDA kernels chosen, an all-greedy batch goes to the one-pass kernel (every row at inverse
    temperature 0) with the lm_head's bf16 logits as they are: torch.argmax's tokens (ties to the lowest column,
    NaN largest), at 1 row (split over many CTAs) and at 40."""
    from minillm.request import Request
    from minillm.sampling.batch import SamplingBatch
    from minillm.sampling.sampler import Sampler
    from minillm.sampling_params import SamplingParams

    seen = _record_kernel_dtypes(monkeypatch)
    vocab = 151936
    g = torch.Generator("cuda").manual_seed(1)
    for n in (1, 40):
        reqs = [Request(f"g{i}", [1, 2], SamplingParams(max_tokens=8, temperature=0.0), eos_token_ids=frozenset())
                for i in range(n)]
        logits = (torch.randn(n, vocab, generator=g, device="cuda") * 3).bfloat16()
        logits[0, [150000, 20]] = 50.0                     # a tie across the row: column 20
        if n > 1:
            logits[1, 99999] = float("nan")
        seen.clear()
        got = Sampler(5, cuda=True)(logits, SamplingBatch.build(reqs, "cuda", vocab))
        assert seen == [torch.bfloat16] and got.logprobs is None
        assert torch.equal(got.token_ids, logits.float().argmax(dim=-1))
        assert got.token_ids[0].item() == 20 and (n == 1 or got.token_ids[1].item() == 99999)


def test_sampler_passes_bf16_logits_unconverted(ops, monkeypatch):
    """The engine's sampler gives the kernel the lm_head's bf16 logits as they are when nothing modifies them,
    and the tokens equal those of the same logits in fp32 (fused path both times, same sampler seed/step)."""
    from minillm.request import Request
    from minillm.sampling.batch import SamplingBatch
    from minillm.sampling.sampler import Sampler
    from minillm.sampling_params import SamplingParams

    seen = _record_kernel_dtypes(monkeypatch)
    vocab = 151936
    reqs = [Request(f"r{i}", [1, 2], SamplingParams(max_tokens=8, temperature=t), eos_token_ids=frozenset())
            for i, t in enumerate([0.0, 0.6, 1.0, 1.7] * 8)]
    g = torch.Generator("cuda").manual_seed(0)
    logits = (torch.randn(len(reqs), vocab, generator=g, device="cuda") * 3).bfloat16()
    kept = logits.clone()
    got = Sampler(5, cuda=True)(logits, SamplingBatch.build(reqs, "cuda", vocab)).token_ids
    ref = Sampler(5, cuda=True)(logits.float(), SamplingBatch.build(reqs, "cuda", vocab)).token_ids
    assert seen == [torch.bfloat16, torch.float32]
    assert torch.equal(got, ref)
    assert torch.equal(logits, kept)


def test_sampler_frequencies_follow_softmax(ops):
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, float("-inf"), -3.0, 1.5], device="cuda")
    n, inv_t = 200_000, 1.7
    tokens = ops.sample_exponential_race(logits.expand(n, -1).contiguous(), torch.full((n,), inv_t, device="cuda"),
                                         5, 0)
    freq = torch.bincount(tokens, minlength=8).double() / n
    p = torch.softmax(logits.double() * inv_t, dim=0)
    assert freq[5] == 0
    assert (freq - p).abs().max().item() < 4 * (0.25 / n) ** 0.5


def _seeded_args(rows, seeds, positions) -> np.ndarray:
    args = np.empty((3, len(rows)), dtype=np.int64)
    args[0] = rows
    args[1] = np.array([s % 2**64 for s in seeds], dtype=np.uint64).view(np.int64)
    args[2] = positions
    return args


@pytest.mark.parametrize("vocab,pad", [(151936, 0), (1001, 3), (6, 0)])
def test_seeded_noise_is_bit_exact_against_its_twin(ops, vocab, pad):
    """cuda/sampling.cu's seeded noise equals, bit for bit, E = -log1p(-u) of the reference's Philox words u
    (seeded_uniform_ref, and the torch twin's on the GPU) with torch's CUDA log1p; rows not listed keep what they held (NaN here). Seeds beyond
    32 bits and negative, positions beyond 32 bits, a position offset, an odd vocab and a row stride wider than
    the vocab."""
    from minillm.ops.sampling_ops import seeded_uniform_ref, seeded_uniform_torch

    args = _seeded_args([7, 0, 3, 8], [1234, -1, 2**40 + 5, 2**63 + 9], [0, 17, 2**33 + 1, 5])
    for offset in (0, 3):
        noise = torch.full((9, vocab + pad), float("nan"), device="cuda")[:, :vocab]
        ops.seeded_exponential_(noise, torch.from_numpy(args).cuda(), offset)
        u = torch.from_numpy(seeded_uniform_ref(args, vocab, offset)).cuda()
        assert torch.equal(seeded_uniform_torch(torch.from_numpy(args).cuda(), vocab, offset), u)
        twin = u.neg().log1p().neg()
        got = noise[torch.from_numpy(args[0]).cuda()]
        diff = (got.view(torch.int32) - twin.view(torch.int32)).abs().max().item()
        assert torch.equal(got, twin), f"offset {offset}: kernel and twin differ by up to {diff} ulp"
        assert torch.isnan(noise[[1, 2, 4, 5, 6]]).all()
        assert (got > 0).all()


def test_seeded_sampler_kernel_gives_the_torch_path_tokens(ops):
    """The sampler's seeded rows, with the kernel (cuda=True) and with the twin (cuda=False), on the same CUDA
    logits: the same tokens, in a batch mixing seeded, unseeded, greedy and top-k rows; and a seeded request's
    token is the same alone and in that batch."""
    from minillm.request import Request
    from minillm.sampling.batch import SamplingBatch
    from minillm.sampling.sampler import Sampler
    from minillm.sampling_params import SamplingParams

    vocab = 151936
    kinds = [dict(temperature=0.9, seed=11), dict(temperature=1.0), dict(temperature=0.0, seed=3),
             dict(temperature=0.7, top_k=50, seed=2**45), dict(temperature=1.1, top_p=0.9, seed=-8)] * 13
    reqs = [Request(f"s{i}", [1, 2], SamplingParams(max_tokens=8, **kw), eos_token_ids=frozenset())
            for i, kw in enumerate(kinds)]
    g = torch.Generator("cuda").manual_seed(2)
    logits = torch.randn(len(reqs), vocab, generator=g, device="cuda") * 2
    got = Sampler(5, cuda=True)(logits.clone(), SamplingBatch.build(reqs, "cuda", vocab)).token_ids
    ref = Sampler(5, cuda=False)(logits.clone(), SamplingBatch.build(reqs, "cuda", vocab)).token_ids
    assert torch.equal(got, ref)
    for i in (0, 3, 9):
        alone = Sampler(7, cuda=True)(logits[i:i + 1].clone(), SamplingBatch.build([reqs[i]], "cuda", vocab))
        assert alone.token_ids.item() == got[i].item()


def test_seeded_noise_bad_arguments_raise_value_error(ops):
    noise = torch.zeros(4, 64, device="cuda")
    args = torch.zeros(3, 2, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match="noise"):
        ops.seeded_exponential_(noise.double(), args)
    with pytest.raises(ValueError, match="args"):
        ops.seeded_exponential_(noise, args.int())
    with pytest.raises(ValueError, match="args"):
        ops.seeded_exponential_(noise, args.cpu())
    with pytest.raises(ValueError, match="offset"):
        ops.seeded_exponential_(noise, args, -1)


def test_bad_arguments_raise_value_error(ops):
    x = torch.zeros(4, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, torch.ones(32, device="cuda", dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="head_dim"):
        ops.qk_norm_rope(torch.zeros(4, 3 * 63, device="cuda", dtype=torch.bfloat16),
                         torch.zeros(4, dtype=torch.long, device="cuda"), torch.zeros(8, 63, device="cuda"),
                         1, 1, 63, None, None, 1e-6)
    with pytest.raises(ValueError, match="seed"):
        ops.sample_exponential_race(x.float(), torch.ones(4, device="cuda"), -1, 0)
    with pytest.raises(ValueError, match="logits"):
        ops.sample_exponential_race(x.double(), torch.ones(4, device="cuda"), 0, 0)


def _random_bitmask(rows: int, vocab: int, seed: int, words: int | None = None) -> torch.Tensor:
    """int32 [rows, words] on the GPU: about an eighth of each row's tokens allowed (xgrammar's layout)."""
    from minillm.sampling.grammar_mask import allowed_tokens
    g = torch.Generator("cuda").manual_seed(seed)
    words = words or (vocab + 31) // 32
    raw = torch.randint(-2 ** 31, 2 ** 31, (rows, words), generator=g, device="cuda", dtype=torch.int64)
    sparse = torch.randint(-2 ** 31, 2 ** 31, (rows, words), generator=g, device="cuda", dtype=torch.int64)
    bits = (raw & sparse & torch.randint(-2 ** 31, 2 ** 31, (rows, words), generator=g, device="cuda",
                                         dtype=torch.int64)).to(torch.int32)   # ~1/8 of the bits set
    assert allowed_tokens(bits, vocab).any(dim=1).all()
    return bits


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("vocab,pad", [(151936, 0), (1001, 0), (4096, 8)])
@pytest.mark.parametrize("rows", [3, 64])
def test_sampler_bitmask_gives_the_tokens_of_the_masked_copy(ops, dtype, vocab, pad, rows):
    """A grammar bitmask read by the race kernel (every row in order, or the rows a list names, with a padded
    word stride) gives bit for bit the tokens of the same kernel on an fp32 copy masked by the grammar mask
    kernel (what the sampler ran before), at every split count; every token is one its bitmask allows.
    (151936, 0): 16-byte loads; 1001 and the misaligned (4096, 8): the scalar path."""
    from minillm.sampling.grammar_mask import GrammarMask, allowed_tokens, apply_grammar_mask
    g = torch.Generator("cuda").manual_seed(vocab + rows)
    logits = (torch.randn(rows, vocab + pad, generator=g, device="cuda") * 4).to(dtype)[:, pad:]
    inv_t = torch.rand(rows, generator=g, device="cuda") * 2 + 0.25
    inv_t[::3] = 0
    for listed in (None, torch.arange(0, rows, 2, device="cuda")):
        m = rows if listed is None else len(listed)
        words = (vocab + 31) // 32
        bitmask = _random_bitmask(m, vocab, rows, words + 5)[:, :words + 1]   # row stride > words
        masked = logits.float()
        apply_grammar_mask(masked, GrammarMask(bitmask.contiguous(), listed), cuda=True)
        want = ops.sample_exponential_race(masked, inv_t, 3, 11, 1)
        for splits in (1, 0, 5):
            got = ops.sample_exponential_race(logits, inv_t, 3, 11, splits, None, bitmask, listed)
            assert torch.equal(got, want), f"splits={splits}: rows {torch.nonzero(got != want).flatten().tolist()}"
        idx = torch.arange(rows, device="cuda") if listed is None else listed
        assert allowed_tokens(bitmask, vocab)[torch.arange(m, device="cuda"), want[idx]].all()


def test_sampler_bitmask_bad_arguments_raise_value_error(ops):
    logits = torch.zeros(4, 100, device="cuda")
    inv_t = torch.ones(4, device="cuda")
    bits = torch.zeros(4, 4, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="threshold"):
        ops.sample_exponential_race(logits, inv_t, 0, 0, 0, torch.zeros(4, device="cuda"), bits)
    with pytest.raises(ValueError, match="bitmask must be int32"):
        ops.sample_exponential_race(logits, inv_t, 0, 0, 0, None, bits[:, :3])
    with pytest.raises(ValueError, match="mask_rows needs a bitmask"):
        ops.sample_exponential_race(logits, inv_t, 0, 0, 0, None, None, torch.zeros(4, dtype=torch.long,
                                                                                    device="cuda"))
    with pytest.raises(ValueError, match="a row per logits row"):
        ops.sample_exponential_race(logits, inv_t, 0, 0, 0, None, bits[:2])


def _norm_chain(ops, x, resid, w, steps):
    """`steps` fused add + RMSNorm kernels back to back, each reading what the one before it has just written."""
    for _ in range(steps):
        x, resid = ops.fused_add_rms_norm(x, resid, w, 1e-6)
    return ops.silu_and_mul(torch.cat([x, resid], dim=1)), resid


def test_pdl_launches_give_the_plain_results_eagerly_and_in_a_graph(ops):
    """With programmatic dependent launch (minillm/ops/launch.py) a kernel may be scheduled before the one it reads
    from has finished; its pdl_wait makes it wait for that grid's writes. A chain of 64 dependent kernels,
    eagerly and captured in a CUDA graph, gives bit for bit the results of plain launches; and the setting is
    per block (the previous one comes back)."""
    from minillm.ops.launch import pdl_launches

    g = torch.Generator("cuda").manual_seed(5)
    x, resid = (torch.randn(37, 1024, generator=g, device="cuda").bfloat16() for _ in range(2))
    w = torch.rand(1024, generator=g, device="cuda").bfloat16() + 0.5
    ref = _norm_chain(ops, x, resid, w, 64)
    with pdl_launches(True):
        assert ops.set_pdl_launches(True) is True   # inside: on
        eager = _norm_chain(ops, x, resid, w, 64)
        static_x, static_r = x.clone(), resid.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _norm_chain(ops, static_x, static_r, w, 64)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = _norm_chain(ops, static_x, static_r, w, 64)
    assert ops.set_pdl_launches(False) is False     # outside: off again
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for got in (eager, static_out):
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
