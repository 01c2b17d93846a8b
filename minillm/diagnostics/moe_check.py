"""The fused MoE kernels against their fp32 torch twins: the `check-kernels` rows (kernel_check.run_cases).

Routing (cuda/moe_routing.cu): ids, counts, offsets, the stable expert order and the active list must equal
route_twin exactly (an error of 0, else inf); the weights within 2e-6. Cases: the Qwen3-30B-A3B shape at decode
batch sizes, top-1, E up to 512, rows of exactly equal logits (ties go to the lower index), every token on one
expert, and a prefill-sized step.

Routing with the router GEMV in (moe_route_gemv, a few tokens): the same integer outputs and weights against
route_twin of the kernel's own fp32 logits, and those logits against F.linear(x.float(), router) relative to their
largest value; on inputs whose sums are exact in fp32 (small integers, many exact ties) the integer outputs must
equal route_twin of F.linear's logits too.

Expert GEMMs (cuda/moe_gemm.cu): act, the weighted per-pair rows and the combined output against experts_twin,
as the largest error relative to the largest reference value. The buffers the kernels write start as NaN, and so
does every weight of the experts no token is routed to: a kernel that reads an unwritten row or an untouched
expert shows as NaN (a non-finite error fails). Cases: experts with zero tokens (B = 1 over 128 experts), every
token on one expert (several passes), more rows per expert than a 32-row pass, top-1, bf16 and fp16; and the
down kernel with the combine in (moe_down_combine, a few tokens: act and the output).
"""
from __future__ import annotations

import math

TOL = {"bfloat16": 2e-2, "float16": 4e-3}
WEIGHT_TOL = 2e-6
LOGIT_TOL = 1e-5   # route_gemv's logits against cuBLAS's: fp32 sums in another order, relative to the largest


def route_cases(quick: bool):
    """(label, tokens, experts, top_k, renormalize, rule)."""
    yield "a3b B=1", 1, 128, 8, True, None
    yield "a3b B=64", 64, 128, 8, True, None
    yield "top1 no-renorm", 37, 8, 1, False, None
    yield "E=512 k=8", 33, 512, 8, True, None
    yield "ties", 30, 16, 4, True, "ties"
    yield "all-on-one", 19, 16, 4, True, "one"
    if not quick:
        yield "a3b B=256", 256, 128, 8, True, None
        yield "prefill 1100", 1100, 64, 2, False, None
        yield "E=60 k=3", 40, 60, 3, True, None


def route_gemv_cases(quick: bool):
    """(label, tokens, experts, top_k, hidden, renormalize, rule, dtype); rule "exact": sums exact in fp32."""
    yield "a3b B=1", 1, 128, 8, 2048, True, None, "bfloat16"
    yield "a3b B=16", 16, 128, 8, 2048, True, None, "bfloat16"
    yield "exact sums, ties", 16, 128, 8, 2048, True, "exact", "bfloat16"
    yield "top1 no-renorm fp16", 7, 8, 1, 256, False, None, "float16"
    if not quick:
        yield "E=512 k=8", 4, 512, 8, 1024, True, None, "bfloat16"
        yield "E=60 k=3 exact", 9, 60, 3, 512, True, "exact", "float16"
        yield "no tokens", 0, 16, 2, 256, True, None, "bfloat16"


def expert_cases(quick: bool):
    """(label, tokens, experts, top_k, hidden, intermediate, rule, down_combine)."""
    yield "a3b B=1 (120 empty experts)", 1, 128, 8, 2048, 768, None, False
    yield "a3b B=8", 8, 128, 8, 2048, 768, None, False
    yield "all-on-one (16-row passes)", 40, 16, 2, 256, 128, "one", False
    yield "top1", 3, 64, 1, 512, 256, None, False
    yield "E=16 k=4 B=200 (32-row passes)", 200, 16, 4, 256, 128, None, False
    yield "a3b B=1 down+combine", 1, 128, 8, 2048, 768, None, True
    yield "a3b B=8 down+combine", 8, 128, 8, 2048, 768, None, True
    yield "top1 down+combine", 3, 64, 1, 512, 256, None, True
    yield "a3b B=16 down+combine", 16, 128, 8, 2048, 768, None, True
    if not quick:
        yield "a3b B=64", 64, 128, 8, 2048, 768, None, False
        yield "a3b B=256", 256, 128, 8, 2048, 768, None, False
        yield "E=16 k=4 B=13", 13, 16, 4, 256, 128, None, False
        yield "H=128 (two row warps at T <= 8)", 5, 16, 2, 128, 128, None, False
        yield "all-on-one down+combine", 16, 16, 2, 256, 128, "one", True
        yield "a3b B=24 down+combine", 24, 128, 8, 2048, 768, None, True


def router_logits(t: int, e: int, seed: int, rule: str | None, device="cpu"):
    """fp32 [t, e] router logits; rule "one": expert e - 1 wins every token by far; "ties": every third row all
    equal, and equal pairs of logits in the next rows."""
    import torch

    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(t, e, generator=g)
    if rule == "one":
        logits[:, e - 1] += 100.0
    elif rule == "ties":
        logits[::3] = 0.5
        logits[1::3, 1::2] = logits[1::3, 0::2][:, : logits[1::3, 1::2].shape[1]]
    return logits.to(device)


def router_inputs(t: int, e: int, h: int, seed: int, rule: str | None, dtype, device="cpu"):
    """(x [t, h] in dtype, router weight [e, h] fp32); rule "exact": x in {-1, 0, 1} and weights in quarters of
    [-1, 1], so every sum is exact in fp32 whatever its order and equal logits are common."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if rule == "exact":
        x = torch.randint(-1, 2, (t, h), generator=g).float()
        w = torch.randint(-4, 5, (e, h), generator=g).float() / 4
        w[1::4] = w[0::4][: w[1::4].shape[0]]   # equal rows: ties in every token
    else:
        x, w = torch.randn(t, h, generator=g), 0.05 * torch.randn(e, h, generator=g)
    return x.to(dtype).to(device), w.to(device)


def _exact(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(a.long(), b.long())


def same_routing(got, want) -> bool:
    """Every integer output of the routing kernels equal (active: its defined part)."""
    e = want.counts.shape[0]
    n = int(want.active[e])
    return _exact(got.experts, want.experts) and _exact(got.counts, want.counts) and \
        _exact(got.offsets, want.offsets) and _exact(got.order, want.order) and int(got.active[e]) == n and \
        _exact(got.active[:n], want.active[:n])


def check_route(t, e, k, renormalize, rule, seed) -> float:
    """0 when every integer output equals the twin's; inf when one differs; else the weights' max abs error."""
    from minillm.ops import moe_ops

    logits = router_logits(t, e, seed, rule, "cuda")
    got, want = moe_ops.route_fused(logits, k, renormalize), moe_ops.route_twin(logits, k, renormalize)
    if not same_routing(got, want):
        return float("inf")
    return float((got.weights - want.weights).abs().max()) if t else 0.0


def check_route_gemv(t, e, k, h, renormalize, rule, dtype_name, seed) -> tuple[float, float]:
    """(the check_route error against route_twin of the kernel's logits, inf also where rule "exact" and the
    integers differ from route_twin of F.linear's; the logits' largest error relative to their largest value)."""
    import torch
    import torch.nn.functional as F

    from minillm.ops import moe_ops

    x, w = router_inputs(t, e, h, seed, rule, getattr(torch, dtype_name), "cuda")
    got, logits = moe_ops.route_gemv(x, w, k, renormalize)
    ref = F.linear(x.float(), w)
    want = moe_ops.route_twin(logits, k, renormalize)
    if not same_routing(got, want) or (rule == "exact" and not same_routing(got, moe_ops.route_twin(ref, k,
                                                                                                    renormalize))):
        return float("inf"), 0.0
    if not t:
        return 0.0, 0.0
    return float((got.weights - want.weights).abs().max()), _rel_err(logits, ref)


def _rel_err(out, ref) -> float:
    import torch

    diff = (out.float() - ref).abs()
    if not torch.isfinite(diff).all():
        return float("nan")
    return float(diff.max() / ref.abs().max().clamp_min(1e-6))


def check_experts(t, e, k, h, i, rule, dtype_name, seed, down_combine=False) -> float:
    """The largest relative error of act, pairs (not with down_combine: there are none) and the output against
    experts_twin (NaN: a poisoned value was read)."""
    import torch

    from minillm.ops import moe_ops

    dev, dt = torch.device("cuda"), getattr(torch, dtype_name)
    g = torch.Generator(device=dev).manual_seed(seed)
    w13 = (0.05 * torch.randn(e, 2 * i, h, generator=g, device=dev)).to(dt)
    w2 = (0.05 * torch.randn(e, h, i, generator=g, device=dev)).to(dt)
    x = torch.randn(t, h, generator=g, device=dev).to(dt)
    r = moe_ops.route_fused(router_logits(t, e, seed, rule, dev), k, True)
    untouched = r.counts == 0
    w13[untouched] = float("nan")
    w2[untouched] = float("nan")
    act = torch.full((t * k, i), float("nan"), dtype=dt, device=dev)
    pairs = torch.full((t * k, h), float("nan"), device=dev)
    out = torch.full((t, h), float("nan"), dtype=dt, device=dev)
    moe_ops.fused_experts(x, w13, w2, r, act=act, pairs=pairs, out=out, down_combine=down_combine)
    want_act, want_pairs, want = moe_ops.experts_twin(x, w13, w2, r)
    errs = [_rel_err(act, want_act), _rel_err(out, want)] + ([] if down_combine else [_rel_err(pairs, want_pairs)])
    return max(errs, key=lambda v: (math.isnan(v), v))


def run_moe_cases(quick: bool) -> list[dict]:
    """check-kernels rows of the fused MoE kernels; none where FUSED_COVERAGE does not cover this GPU."""
    import torch

    from minillm.ops import moe_ops

    if moe_ops.FUSED_COVERAGE.reason(dtype="bfloat16", capability=torch.cuda.get_device_capability()):
        return []
    rows, seed = [], 100
    for label, t, e, k, renorm, rule in route_cases(quick):
        seed += 1
        err = check_route(t, e, k, renorm, rule, seed)
        rows.append(dict(case=f"moe_route {label} T{t} E{e} k{k}{'' if renorm else ' no-renorm'}",
                         max_abs_err=err, tol=WEIGHT_TOL, passed=err <= WEIGHT_TOL))
    for label, t, e, k, h, renorm, rule, dt in route_gemv_cases(quick):
        seed += 1
        err, logit_err = check_route_gemv(t, e, k, h, renorm, rule, dt, seed)
        name = f"moe_route_gemv {label} T{t} E{e} k{k} H{h} {dt}{'' if renorm else ' no-renorm'}"
        rows.append(dict(case=name, max_abs_err=err, tol=WEIGHT_TOL, passed=err <= WEIGHT_TOL))
        rows.append(dict(case=f"{name} logits (rel. err)", max_abs_err=logit_err, tol=LOGIT_TOL,
                         passed=logit_err <= LOGIT_TOL))
    for label, t, e, k, h, i, rule, down_combine in expert_cases(quick):
        op = "moe_down_combine" if down_combine else "moe_experts"
        for dt in ("bfloat16", "float16"):
            seed += 1
            err = check_experts(t, e, k, h, i, rule, dt, seed, down_combine)
            rows.append(dict(case=f"{op} {label} T{t} E{e} k{k} H{h} I{i} {dt} (rel. err)", max_abs_err=err,
                             tol=TOL[dt], passed=err <= TOL[dt]))
    return rows
