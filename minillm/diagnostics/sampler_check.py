"""The sampler's truncation-threshold kernel (cuda/sampling_topp.cu) against its sort-based torch path: the
`check-kernels` rows (kernel_check.run_cases) and the rule tests/test_sampling_topp_gpu.py applies.

What must agree is each row's kept set (logit >= threshold). Top-k and min-p thresholds are exact (a k-th value, a
max plus a logarithm). Top-p sums probabilities in another order than the sort's cumsum (the kernel in fixed
point), so a token may differ only where the mass before it (float64, renormalised over the top-k mass) lies
within BOUNDARY of p: over 151,936 tokens a few tokens' masses can fall inside that band, so counting the
differing tokens is no rule.
"""
from __future__ import annotations

import math

BOUNDARY = 1e-5


def preceding_mass(row, k: int):
    """Per column of one row: the float64 mass of the values strictly above its value, over the top-k mass."""
    import torch

    x = row.double()
    probs = (x - x.max()).exp()
    order = x.sort(descending=True)
    s, ps = order.values, probs[order.indices]
    top_k_mass = ps[:k].sum()
    excl = ps.cumsum(0) - ps
    first = torch.searchsorted(-s, -s, side="left")     # first position of each value's tie group
    out = torch.empty_like(x)
    out[order.indices] = excl[first]
    return out / top_k_mass


def kept_set_gap(logits, got, ref, k, p) -> tuple[float, str]:
    """The largest distance from p of the preceding mass of a token whose kept state differs between thresholds
    got and ref [N, 1] (0 where every row agrees; inf where a row without top-p differs or keeps nothing), and
    a line naming the worst row."""
    kept, kept_ref = logits >= got, logits >= ref
    vocab = logits.shape[1]
    worst, where = 0.0, ""
    for r in range(logits.shape[0]):
        if not bool(kept[r].any()) and bool(logits[r].isfinite().any()):
            return math.inf, f"row {r}: nothing kept"
        if bool((kept[r] == kept_ref[r]).all()):
            continue
        pr = 1.0 if p is None else float(p[r])
        kr = vocab if k is None else int(k[r])
        diff = (kept[r] != kept_ref[r]).nonzero().flatten()
        if pr >= 1.0:
            return math.inf, f"row {r} (top_k={kr}, no top-p): {diff.numel()} tokens differ"
        dist = float((preceding_mass(logits[r], kr)[diff] - pr).abs().max())
        if dist > worst:
            worst, where = dist, (f"row {r} (top_k={kr}, top_p={pr}): {diff.numel()} tokens differ, preceding "
                                  f"mass up to {dist:.3g} from p")
    return worst, where


def run_threshold_cases() -> list[dict]:
    """Mixed top-k / top-p / min-p rows over 151,936 and 1,001 tokens, spread and peaked, against the torch path
    in float64 (float32's cumsum over 151,936 tokens errs by more than a token's mass). The error is
    kept_set_gap, at most BOUNDARY; NaN if any threshold is NaN (the op's output block is NaN-poisoned first)."""
    import torch

    from minillm.ops.sampling_ops import truncation_threshold, truncation_threshold_torch

    rows = []
    for vocab in (151936, 1001):
        for label, scale in (("spread", 3.0), ("peaked", 12.0)):
            gen = torch.Generator(device="cuda").manual_seed(vocab)
            logits = torch.randn(64, vocab, generator=gen, device="cuda") * scale
            n = logits.shape[0]
            k = torch.tensor([(0, 1, 40, 1000)[i % 4] or vocab for i in range(n)], device="cuda")
            p = torch.tensor([(0.9, 0.5, 1.0, 0.99, 1e-6)[i % 5] for i in range(n)], device="cuda")
            min_p = torch.tensor([(0.0, 0.0, 0.05)[i % 3] for i in range(n)], device="cuda")
            poison = [torch.full((n,), float("nan"), device="cuda") for _ in range(8)]
            del poison   # the op's small allocations reuse these blocks: a row the kernel skips stays NaN
            got = truncation_threshold(logits, k, p, min_p, 1000, cuda=True)
            wide = logits.double()
            ref = truncation_threshold_torch(wide, k, p.double(), min_p.double(), 1000)
            gap, where = kept_set_gap(wide, got.double(), ref, k, p)
            err = float("nan") if got.isnan().any() else gap
            row = dict(case=f"sampler threshold {label} V={vocab}", max_abs_err=err, tol=BOUNDARY,
                       passed=err <= BOUNDARY)
            if where:
                row["worst"] = where
            rows.append(row)
    return rows
