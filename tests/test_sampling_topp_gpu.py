"""GPU checks of the truncation-threshold kernel (cuda/sampling_topp.cu, sampling_ops.truncation_threshold with
cuda=True) against its sort-based torch path (truncation_threshold_torch), and of the sampler with the kernel
against the sampler without it. Skipped without CUDA.

What must agree: the kept set (logit >= threshold) of every row, by minillm/diagnostics/sampler_check.py's rule
(check-kernels applies it too): exact for top-k and min-p; for top-p a token may differ only where its preceding
mass lies within BOUNDARY of p.
The extension is the project build, or the library named by MINILLM_FUSED_EXT_LIB (scripts/device_fused.sh)."""
import pytest
import torch
from test_fused_gpu import ops  # noqa: F401 - the fixture: the project build or MINILLM_FUSED_EXT_LIB

from minillm.diagnostics.sampler_check import BOUNDARY, kept_set_gap
from minillm.ops.sampling_ops import truncation_threshold, truncation_threshold_torch

pytestmark = pytest.mark.gpu

VOCABS = [151936, 1001]
PS = [1e-6, 0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0]


def _params(n, vocab, ks=None, ps=None, min_ps=None):
    """Row parameters on the GPU as SamplingBatch holds them (k = vocab and p = 1 mean off), cycled over n rows."""
    def cycle(values, dtype):
        return None if values is None else torch.tensor([values[i % len(values)] for i in range(n)], dtype=dtype,
                                                         device="cuda")
    k = cycle([v if 0 < v < vocab else vocab for v in ks] if ks is not None else None, torch.int64)
    max_k = int(k[k < vocab].max()) if k is not None and bool((k < vocab).any()) else 0
    return k, cycle(ps, torch.float32), cycle(min_ps, torch.float32), max_k


def _check(logits, k, p, min_p, max_k):
    """Kernel thresholds against the torch path's, row by row; returns the kernel's."""
    got = truncation_threshold(logits, k, p, min_p, max_k, cuda=True)
    ref = truncation_threshold_torch(logits, k, p, min_p, max_k)
    assert got.shape == ref.shape == (logits.shape[0], 1) and got.dtype == torch.float32
    assert not got.isnan().any()
    gap, where = kept_set_gap(logits, got, ref, k, p)
    assert gap <= BOUNDARY, where
    return got


def _rows(kind, n, vocab, gen):
    randn = lambda: torch.randn(n, vocab, generator=gen, device="cuda")   # noqa: E731
    if kind == "normal":
        return randn() * 3
    if kind == "peaked":       # one token holds almost all the mass
        x = randn()
        x[:, 7] = 40.0
        return x
    if kind == "two_peaks":    # the crossing token is the second of two near-equal peaks
        x = randn() - 20
        x[:, 3], x[:, vocab - 2] = 5.0, 4.9
        return x
    if kind == "flat":         # every value equal: ties everywhere, everything kept
        return torch.full((n, vocab), 0.25, device="cuda")
    if kind == "ties":         # a handful of distinct values
        return torch.randint(0, 6, (n, vocab), generator=gen, device="cuda").float()
    if kind == "bf16":         # fp32 logits widened from bf16 (the lm_head's dtype): many exact ties
        return (randn() * 4).bfloat16().float()
    if kind == "neg_inf":      # masked entries (a grammar, a ban): half of every row at -inf
        x = randn() * 2
        x[:, ::2] = -float("inf")
        return x
    if kind == "zeros_signed":  # -0 and +0 are one value
        x = torch.zeros(n, vocab, device="cuda")
        x[:, ::3] = -0.0
        x[:, 5] = 1.0
        return x
    raise ValueError(kind)


KINDS = ["normal", "peaked", "two_peaks", "flat", "ties", "bf16", "neg_inf", "zeros_signed"]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("kind", KINDS)
def test_top_p_matches_torch(ops, vocab, kind):
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = _rows(kind, len(PS), vocab, gen)
    _check(logits, *_params(len(PS), vocab, ps=PS))


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("kind", KINDS)
def test_top_k_matches_torch(ops, vocab, kind):
    ks = [1, 2, 5, 50, 1000, vocab - 1, vocab]
    gen = torch.Generator(device="cuda").manual_seed(2)
    logits = _rows(kind, len(ks), vocab, gen)
    k, _, _, max_k = _params(len(ks), vocab, ks=ks)
    got = _check(logits, k, None, None, max_k)
    ref = truncation_threshold_torch(logits, k, None, None, max_k)
    assert torch.equal(got, ref)   # a k-th value is exact


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("kind", KINDS)
def test_top_k_then_top_p_and_min_p_match_torch(ops, vocab, kind):
    ks, ps, mps = [1, 3, 40, 1000, vocab, 20], [0.9, 0.5, 0.95, 0.3, 0.8, 1.0, 1e-6], [0.0, 0.1, 0.0, 0.02, 0.5]
    n = 2 * 3 * 5 * 7
    gen = torch.Generator(device="cuda").manual_seed(3)
    logits = _rows(kind, n, vocab, gen)
    _check(logits, *_params(n, vocab, ks=ks, ps=ps, min_ps=mps))


def test_min_p_alone_is_exact(ops):
    gen = torch.Generator(device="cuda").manual_seed(4)
    logits = torch.randn(5, 151936, generator=gen, device="cuda") * 3
    _, _, mp, _ = _params(5, 151936, min_ps=[0.0, 1e-4, 0.05, 0.5, 1.0])
    got = truncation_threshold(logits, None, None, mp, cuda=True)
    assert torch.equal(got, truncation_threshold_torch(logits, None, None, mp))


def test_degenerate_rows(ops):
    """All -inf (nothing to keep: threshold -inf), one finite token, +inf tokens, p and k at their limits."""
    vocab = 1024
    inf = float("inf")
    logits = torch.randn(6, vocab, device="cuda")
    logits[0] = -inf
    logits[1] = -inf
    logits[1, 77] = 3.0
    logits[2, [5, 9]] = inf
    k, p, _, max_k = _params(6, vocab, ks=[vocab, 1, 0, 1, vocab - 1, 2], ps=[0.9, 0.9, 0.5, 1.0, 1e-6, 1.0])
    got = _check(logits, k, p, None, max_k)
    assert float(got[0]) == -inf
    assert (logits[1] >= got[1]).nonzero().flatten().tolist() == [77]


def test_scalar_path_and_strided_rows(ops):
    """A row view that starts off the 16-byte grid (the scalar loads) and a row stride wider than the vocab."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    wide = torch.randn(4, 151936 + 8, generator=gen, device="cuda") * 3
    for view in (wide[:, 1:151937], wide[:, :151936]):
        _check(view, *_params(4, 151936, ks=[0, 50, 0, 7], ps=[0.9, 0.9, 0.5, 1.0]))


@pytest.mark.parametrize("rows", [1, 300])
def test_batch_sizes_and_determinism(ops, rows):
    """More rows than SMs; and every call gives the same thresholds bit for bit (fixed-point mass sums)."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    logits = torch.randn(rows, 151936, generator=gen, device="cuda") * 2.5
    params = _params(rows, 151936, ks=[0, 0, 64], ps=[0.9, 0.95, 0.8, 0.6], min_ps=[0.0, 0.0, 0.0, 0.01])
    first = _check(logits, *params)
    for _ in range(3):
        assert torch.equal(truncation_threshold(logits, *params, cuda=True), first)


@pytest.mark.parametrize("vocab", [151936, 1001, 20])
def test_split_rows_give_the_one_cta_thresholds(ops, vocab):
    """Several CTAs per row (a cluster on sm_90; elsewhere the op runs one CTA whatever is asked) sum integer
    histograms, so every split count gives the one-CTA thresholds bit for bit, empty slices included (V=20 with 8
    CTAs: 4-column slices, the last three empty)."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    for rows in (1, 3):
        logits = torch.randn(rows, vocab, generator=gen, device="cuda") * 3
        k, p, mp, _ = _params(rows, vocab, ks=[0, 5, 0], ps=[0.9, 0.7, 1.0], min_ps=[0.0, 0.0, 0.1])
        lmp = mp.log()
        one = ops.truncation_threshold(logits, k, p, lmp, 1)
        for splits in (0, 2, 4, 8):
            assert torch.equal(ops.truncation_threshold(logits, k, p, lmp, splits), one), f"rows={rows} {splits}"
        _check(logits, k, p, mp, int(k[k < vocab].max()) if bool((k < vocab).any()) else 0)


def test_bad_arguments_raise_value_error(ops):
    logits = torch.randn(2, 100, device="cuda")
    with pytest.raises(ValueError, match="logits must be a float32"):
        ops.truncation_threshold(logits.half(), None, None, None)
    with pytest.raises(ValueError, match="top_k must be contiguous"):
        ops.truncation_threshold(logits, torch.ones(3, dtype=torch.int64, device="cuda"), None, None)
    with pytest.raises(ValueError, match="top_p must be contiguous"):
        ops.truncation_threshold(logits, None, torch.ones(2, dtype=torch.float64, device="cuda"), None)
    with pytest.raises(ValueError, match="splits must be"):
        ops.truncation_threshold(logits, None, None, None, 9)


def _requests(n):
    from minillm.request import Request
    from minillm.sampling_params import SamplingParams

    kinds = [dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_p=0.5, top_k=40),
             dict(temperature=0.8, top_k=20), dict(temperature=0.9, min_p=0.05, top_p=0.95),
             dict(temperature=0.0), dict(temperature=0.6, top_p=0.8, seed=11)]
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8, **kinds[i % len(kinds)]))
            for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_with_kernel_picks_the_torch_paths_tokens(ops, dtype):
    """Sampler(cuda=True) (threshold kernel) against Sampler(cuda=False) (sort), same seed, hence the same noise:
    on every row whose kept set is the same (all but exact top-p boundary cases, checked by _check), the same
    token, step after step."""
    from minillm.sampling.batch import SamplingBatch
    from minillm.sampling.sampler import Sampler

    vocab, n = 151936, 48
    batch = SamplingBatch.build(_requests(n), "cuda", vocab)
    with_kernel, without = Sampler(5, cuda=True), Sampler(5, cuda=False)
    gen = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(4):
        logits = (torch.randn(n, vocab, generator=gen, device="cuda") * 3).to(dtype)
        scaled = logits.float() / batch.temperature
        got = _check(scaled, batch.top_k, batch.top_p, batch.min_p, batch.max_top_k)
        ref = truncation_threshold_torch(scaled, batch.top_k, batch.top_p, batch.min_p, batch.max_top_k)
        same = ((scaled >= got) == (scaled >= ref)).all(dim=1)
        a = with_kernel(logits.clone(), batch).token_ids
        b = without(logits.clone(), batch).token_ids
        assert torch.equal(a[same], b[same])
        assert bool(same.float().mean() >= 0.9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 0])
def test_race_with_threshold_is_the_race_on_masked_logits(ops, dtype, splits):
    """The race kernel given a threshold skips what masked_fill(logits < threshold, -inf) removes: the same token
    bit for bit as the race on the masked logits (one CTA per row, and the automatic split)."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    n, vocab = 12, 151936
    logits = (torch.randn(n, vocab, generator=gen, device="cuda") * 3).to(dtype)
    wide = logits.float()
    k, p, mp, max_k = _params(n, vocab, ks=[0, 20, 1], ps=[0.9, 0.5, 1.0, 1e-6], min_ps=[0.0, 0.05])
    thr = truncation_threshold(wide, k, p, mp, max_k, cuda=True).squeeze(1)
    inv_t = torch.rand(n, generator=gen, device="cuda") + 0.5
    inv_t[3] = 0.0                                           # a greedy row: the argmax of its kept logits
    masked = wide.masked_fill(wide < thr[:, None], -float("inf"))
    for offset in (1, 2):
        got = ops.sample_exponential_race(logits, inv_t, 5, offset, splits, thr)
        assert torch.equal(got, ops.sample_exponential_race(masked, inv_t, 5, offset, splits))
        assert bool((wide.gather(1, got[:, None]).squeeze(1) >= thr).all())


def test_fused_truncated_sampler_draws_from_the_masked_softmax(ops):
    """Sampler(cuda=True), no seeds or logprobs: logits / T, the threshold kernel, the race with the threshold.
    Over many rows of the same logits the draws follow softmax(logits / T) restricted to the kept set."""
    from minillm.request import Request
    from minillm.sampling.batch import SamplingBatch
    from minillm.sampling.sampler import Sampler
    from minillm.sampling_params import SamplingParams

    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0] * 4, device="cuda")   # V = 32, ties
    n, t = 20000, 0.8
    sp = SamplingParams(max_tokens=8, temperature=t, top_p=0.75, top_k=20)
    batch = SamplingBatch.build([Request(f"r{i}", [1], sp) for i in range(n)], "cuda", base.numel())
    tokens = Sampler(3, cuda=True)(base.repeat(n, 1).bfloat16(), batch).token_ids
    scaled = (base / t)[None]
    thr = truncation_threshold_torch(scaled, batch.top_k[:1], batch.top_p[:1], None, batch.max_top_k)
    kept = (scaled >= thr)[0]
    probs = (scaled[0].softmax(-1) * kept).double()
    probs /= probs.sum()
    counts = torch.bincount(tokens, minlength=base.numel()).double()
    assert counts[~kept].sum() == 0
    expected = n * probs[kept]
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    # Kept: the 12 tokens of the top three values (ties kept; top-20 mass before the 9th token 0.746 < 0.75), so
    # 11 degrees of freedom: chi2 > 45 has p < 1e-5.
    assert int(kept.sum()) == 12
    assert chi2 < 45
