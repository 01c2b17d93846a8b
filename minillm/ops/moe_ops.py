"""Mixture-of-experts ops: top-k routing and the grouped expert MLP (Qwen3-MoE).

Expert weights are stacked per layer: w13 [E, 2I, H] (each expert's gate rows, then its up rows, as in
MLP.gate_up_proj) and w2 [E, H, I]. A step's T tokens pick k experts each; the T*k (token, slot) pairs are sorted
by expert so that each expert's rows are contiguous, and `offsets` marks where each expert's group starts.

Two torch paths compute the experts:
- `torch._grouped_mm` over the sorted rows, with the group ends on the device: no host sync, so the shapes a
  CUDA graph captures stay valid whatever the per-step expert counts are (graph-safe). It needs row strides that
  are multiples of 16 bytes and, on CUDA, bf16.
- a loop over the experts that have rows (the reference, and the fallback where grouped_mm cannot run). It reads
  the counts on the host: never inside a CUDA graph (`grouped_mm_unsupported_reason` says when that path runs).

And minillm's fused kernels for decode-sized steps (cuda/moe_routing.cu, cuda/moe_gemm.cu; the execution plan
puts a model on them, minillm/runner/plan.py): `route_fused` (two launches: softmax, top-k, renormalise, counts,
offsets, the stable expert order and the list of experts with rows) and `fused_experts` (gate_up with SwiGLU,
down with the routing weight, a fixed-order combine: three launches over the touched experts only, each
expert's weights read once). Graph-safe: every size depends on the token count alone. Their torch twins are
`route_twin` and `experts_twin`. For a few tokens two fused variants cut the launches (each costs a few
microseconds at decode, more than the work in it): `route_gemv` takes the router GEMV into the routing launch,
and `fused_experts(down_combine=True)` the combine into the down launch. `fused_moe` is the layer on the fused
kernels, and `moe_variant` the one place that decides which variants a step of T tokens takes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minillm.ops.coverage import KernelCoverage
from minillm.ops.fused_ops import silu_and_mul

# The fused decode kernels (moe.h): mma.sync and cache-hinted loads of sm_80; no host sync and no allocation that
# depends on the routing (graph-safe).
FUSED_COVERAGE = KernelCoverage("moe", dtypes=("bfloat16", "float16"), min_capability=(8, 0), graph_safe=True)
MAX_EXPERTS = 512       # kMoeMaxExperts
MAX_TOP_K = 8           # kMoeMaxTopK
TILE_K = 32             # kMoeTileK: hidden and moe_intermediate_size are multiples
K_WARPS = 4             # kMoeKWarps: ... of at least TILE_K * K_WARPS
GATE_COLS = 16          # kMoeGateCols: moe_intermediate_size is a multiple
DOWN_COLS = 32          # kMoeDownCols: hidden_size is a multiple
# Steps of up to this many tokens take the fused kernels (the plan's max_rows); longer ones (prefill) keep
# grouped_mm, whose tensor-core tiles suit thousands of rows. Measured on the H200 (scripts/moe_bench.py, one
# Qwen3-30B-A3B layer, 3cc5ae7): fused 481 vs 540 us at 256 tokens, 703 vs 588 at 512, and 2.2-3.8x slower from
# 1,024 to 16,384 (66 TFLOP/s against grouped_mm's 109-252).
FUSED_MAX_TOKENS = 256
ROUTE_GEMV_TOKENS = 16   # kMoeRouteGemvTokens: the most tokens route_gemv takes
DOWN_COMBINE_COLS = 16   # kMoeDownCombineCols: hidden_size is a multiple (so is DOWN_COLS)
# Steps of up to this many tokens route in one launch (route_gemv; its last CTA's top-k and grouping grow with
# T) and take down with the combine in (its CTAs read each expert once per token that picked it, where moe_down
# reads it once per step). Measured on the H200 (scripts/moe_bench.py --variants, one Qwen3-30B-A3B layer,
# b0ac424): both on against the launch chain 37.4 / 92.4 / 151.1 / 185.4 / 226.0 us against 44.1 / 106.8 /
# 165.8 / 210.6 / 251.4 at 1 / 4 / 8 / 12 / 16 tokens; the combine alone still won at 24 (299.5 against 312.2)
# and was even at 32 (343.9 against 346.0). 16 is as far as the GPU tests have checked it.
ROUTE_GEMV_MAX_TOKENS = 16
DOWN_COMBINE_MAX_TOKENS = 16


@dataclass(frozen=True)
class Routing:
    """Which experts each token uses, and the expert-sorted order of the (token, slot) pairs."""
    weights: torch.Tensor    # [T, k], the activation dtype (HF casts the fp32 probabilities back); fused: fp32
    experts: torch.Tensor    # [T, k] int64 expert ids (fused: int32)
    order: torch.Tensor      # [T * k] int64 (fused: int32): pair index token * k + slot, sorted by expert, stable
    counts: torch.Tensor     # [E] int32 pairs routed to each expert
    offsets: torch.Tensor    # [E + 1] int32: expert e's rows are order[offsets[e]:offsets[e + 1]]
    # The fused kernels' routing only: [E + 1] int32, active[E] = experts with rows, active[:active[E]] their ids.
    active: torch.Tensor | None = None


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          weight_dtype: torch.dtype | None = None) -> Routing:
    """Softmax in fp32 over the experts, the top-k of it, renormalised to sum 1 when `renormalize`
    (norm_topk_prob), then the per-expert counts and offsets. router_logits [T, E]; the routing weights are
    returned in weight_dtype (default: the logits' dtype). Exactly equal probabilities come out in torch.topk's
    order, which torch leaves unspecified (on CPU it is not by index), as in transformers; the routing kernel
    picks the lower expert index (route_twin)."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    counts, offsets, order = expert_groups(experts, router_logits.shape[-1])
    return Routing(weights.to(weight_dtype or router_logits.dtype), experts, order, counts, offsets)


def expert_groups(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counts [E], offsets [E + 1], order [T * k]) of expert ids [T, k], with device ops only (no sync)."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return counts, offsets, order


def grouped_mm_unsupported_reason(device: torch.device, dtype: torch.dtype, hidden: int,
                                  intermediate: int) -> str | None:
    """Why the graph-safe grouped_mm path cannot run these experts (then the host-synced loop does), or None."""
    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    return grouped_mm_coverage_reason(device.type, capability, dtype, hidden, intermediate)


def grouped_mm_coverage_reason(device_type: str, capability: tuple[int, int], dtype: torch.dtype, hidden: int,
                               intermediate: int) -> str | None:
    """grouped_mm_unsupported_reason on plain device facts (the execution plan asks before the model exists)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if device_type == "cuda":
        if dtype != torch.bfloat16:
            return f"torch._grouped_mm on CUDA needs bfloat16, the model is {dtype}"
        if tuple(capability)[0] < 9:
            return "torch._grouped_mm on CUDA needs sm_90 or newer"
    elif dtype not in (torch.float32, torch.bfloat16):
        return f"torch._grouped_mm on CPU takes float32 or bfloat16, the model is {dtype}"
    size = torch.tensor([], dtype=dtype).element_size()
    if (hidden * size) % 16 or (intermediate * size) % 16:
        return f"hidden={hidden} and moe_intermediate_size={intermediate} rows must be multiples of 16 bytes"
    return None


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing, *,
                    graph_safe: bool | None = None, cuda: bool = False) -> torch.Tensor:
    """sum over k of weight * down_e(silu(gate_e(x)) * up_e(x)) for each token's experts e: [T, H].

    graph_safe None: grouped_mm wherever it can run; True/False force that path (tests compare the two).
    cuda: the SwiGLU between the two GEMMs may take minillm's fused kernel (the engine's KernelChoice)."""
    t, k = routing.experts.shape
    if graph_safe is None:
        graph_safe = grouped_mm_unsupported_reason(x.device, x.dtype, x.shape[-1], w2.shape[-1]) is None
    rows = x[routing.order // k]                       # [T*k, H], grouped by expert
    if graph_safe:
        ends = routing.offsets[1:]
        h = torch._grouped_mm(rows, w13.transpose(1, 2), offs=ends)
        y = torch._grouped_mm(silu_and_mul(h, cuda=cuda), w2.transpose(1, 2), offs=ends)
    else:
        y = _expert_loop(rows, w13, w2, routing.offsets, cuda)
    pairs = torch.empty_like(y)
    pairs[routing.order] = y                           # back to (token, slot) order
    return (pairs.view(t, k, -1) * routing.weights.unsqueeze(-1)).sum(dim=1)


def _expert_loop(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor,
                 cuda: bool = False) -> torch.Tensor:
    """The reference: each expert with rows runs its own SwiGLU MLP (reads the offsets on the host)."""
    y = torch.empty(rows.shape[0], w2.shape[1], dtype=rows.dtype, device=rows.device)
    bounds = offsets.tolist()
    for e in range(w13.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            y[lo:hi] = F.linear(silu_and_mul(F.linear(rows[lo:hi], w13[e]), cuda=cuda), w2[e])
    return y


def moe_reference(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                  renormalize: bool) -> torch.Tensor:
    """Independent plain-torch twin of route + grouped_experts, token by token in float64 (for tests)."""
    xd = x.double()
    probs = torch.softmax(F.linear(x, router_weight).double(), dim=-1)
    out = torch.zeros_like(xd)
    for t in range(x.shape[0]):
        w, ids = torch.topk(probs[t], top_k)
        if renormalize:
            w = w / w.sum()
        for weight, e in zip(w.tolist(), ids.tolist()):
            gate, up = F.linear(xd[t], w13[e].double()).chunk(2)
            out[t] += weight * F.linear(F.silu(gate) * up, w2[e].double())
    return out


# ---- the fused decode kernels and their torch twins -----------------------------------------------------------

def fused_shape_reason(num_experts: int, top_k: int, hidden: int, intermediate: int) -> str | None:
    """Why the fused MoE kernels do not take a layer of these sizes (moe.h's limits), or None."""
    if not 1 <= num_experts <= MAX_EXPERTS:
        return f"num_experts={num_experts} (at most {MAX_EXPERTS})"
    if not 1 <= top_k <= min(MAX_TOP_K, num_experts):
        return f"num_experts_per_tok={top_k} (at most {MAX_TOP_K})"
    if hidden % TILE_K or hidden < TILE_K * K_WARPS or hidden % DOWN_COLS:
        return f"hidden_size={hidden} (a multiple of {max(TILE_K, DOWN_COLS)}, at least {TILE_K * K_WARPS})"
    if intermediate % TILE_K or intermediate < TILE_K * K_WARPS or intermediate % GATE_COLS:
        return f"moe_intermediate_size={intermediate} (a multiple of {TILE_K}, at least {TILE_K * K_WARPS})"
    return None


def route_fused(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """route() on the routing kernel: router_logits [T, E] fp32 on a CUDA device. Weights stay fp32 (the down
    kernel multiplies in fp32); on exactly equal logits the lower expert index is chosen first (route_twin)."""
    ids, weights, counts, offsets, order, active = torch.ops.minillm.moe_route(router_logits, top_k, renormalize)
    return Routing(weights, ids, order, counts, offsets, active)


_ROUTE_COUNTERS: dict[torch.device, torch.Tensor] = {}


def route_counter(device: torch.device) -> torch.Tensor:
    """route_gemv's ticket counter on this device: one int32 word that is 0 between launches (each launch leaves
    it so). Made at the first use, which the runner's warm-up makes outside any graph capture. One per device, so
    route_gemv must not run on two streams of a device at once (the engine runs its layers in one stream)."""
    device = torch.device(device)
    counter = _ROUTE_COUNTERS.get(device)
    if counter is None:
        with torch.inference_mode(False):   # a plain tensor: the op writes it, in inference mode or not
            counter = _ROUTE_COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def route_gemv(x: torch.Tensor, router_weight: torch.Tensor, top_k: int,
               renormalize: bool) -> tuple[Routing, torch.Tensor]:
    """route_fused(F.linear(x.float(), router_weight)) in one launch, for up to ROUTE_GEMV_TOKENS tokens: x [T, H]
    bf16 / fp16, router_weight [E, H] fp32. Returns the routing and the fp32 logits it chose on (each product and
    sum in fp32, in another order than cuBLAS: last-bit differences)."""
    logits, ids, weights, counts, offsets, order, active = torch.ops.minillm.moe_route_gemv(
        x, router_weight, top_k, renormalize, route_counter(x.device))
    return Routing(weights, ids, order, counts, offsets, active), logits


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing, *,
                  act: torch.Tensor | None = None, pairs: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, down_combine: bool = False) -> torch.Tensor:
    """grouped_experts on the fused kernels, for a route_fused routing. act [T*k, I] (x's dtype), pairs [T*k, H]
    (fp32) and out [T, H] are the kernels' buffers; None allocates them (check-kernels passes NaN-filled ones).
    down_combine: down and combine in one launch, no pairs (the same sums, each dot product in another order)."""
    t, k = routing.experts.shape
    n, h, i = t * k, x.shape[-1], w2.shape[-1]
    act = torch.empty(n, i, dtype=x.dtype, device=x.device) if act is None else act
    out = torch.empty(t, h, dtype=x.dtype, device=x.device) if out is None else out
    ops = torch.ops.minillm
    ops.moe_gate_up(x, w13, routing.order, routing.offsets, routing.active, k, act)
    if down_combine:
        ops.moe_down_combine(act, w2, routing.experts, routing.weights, routing.order, k, out)
        return out
    pairs = torch.empty(n, h, dtype=torch.float32, device=x.device) if pairs is None else pairs
    ops.moe_down(act, w2, routing.weights, routing.order, routing.offsets, routing.active, k, pairs)
    ops.moe_combine(pairs, k, out)
    return out


@dataclass(frozen=True)
class MoeVariant:
    """Which fused kernels a step takes: routing in one launch with the router GEMV; down with the combine."""
    route_gemv: bool
    down_combine: bool


def moe_variant(tokens: int) -> MoeVariant:
    """The one decision, on the token count alone (a graph captured for T tokens keeps it)."""
    return MoeVariant(route_gemv=tokens <= ROUTE_GEMV_MAX_TOKENS, down_combine=tokens <= DOWN_COMBINE_MAX_TOKENS)


def fused_route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool,
                variant: MoeVariant | None = None) -> Routing:
    """The routing of fused_moe: route_gemv, or the fp32 router GEMV and route_fused (as Router.logits)."""
    variant = variant or moe_variant(x.shape[0])
    if variant.route_gemv:
        return route_gemv(x, router_weight, top_k, renormalize)[0]
    return route_fused(F.linear(x.float(), router_weight), top_k, renormalize)


def fused_moe(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool) -> torch.Tensor:
    """The MoE layer on the fused kernels: x [T, H], the fp32 router weight [E, H], the stacked experts."""
    variant = moe_variant(x.shape[0])
    routing = fused_route(x, router_weight, top_k, renormalize, variant)
    return fused_experts(x, w13, w2, routing, down_combine=variant.down_combine)


def active_experts(counts: torch.Tensor) -> torch.Tensor:
    """The routing kernel's active list of per-expert counts: [E + 1] int32, the ids with rows ascending, then
    zeros, and their number last."""
    e = counts.shape[0]
    ids = torch.nonzero(counts > 0).flatten().to(torch.int32)
    active = torch.zeros(e + 1, dtype=torch.int32, device=counts.device)
    active[:ids.numel()] = ids
    active[e] = ids.numel()
    return active


def route_twin(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """The routing kernel's torch twin: route() with the kernel's rule on equal logits (lower index first, by a
    stable sort of the logits) and its int32 / fp32 outputs. NaN logits aside: the kernel takes a NaN logit as -inf
    (probability 0, ranked last, so every id stays a real expert), torch's softmax makes the token's weights NaN. Entries of `active` past its count are not compared
    (the kernel leaves them unwritten); use `active_experts` for the defined part."""
    logits = router_logits.float()
    probs = F.softmax(logits, dim=-1)
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    counts, offsets, order = expert_groups(ids, logits.shape[-1])
    return Routing(weights, ids.to(torch.int32), order.to(torch.int32), counts, offsets, active_experts(counts))


def experts_twin(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing):
    """fused_experts' torch twin in fp32, stage by stage: (act [T*k, I] in expert order, pairs [T*k, H] weighted
    in (token, slot) order, out [T, H]). Loops over the experts with rows (host sync: tests only)."""
    t, k = routing.experts.shape
    order = routing.order.long()
    rows = x.float()[order // k]
    act = torch.empty(rows.shape[0], w2.shape[-1], dtype=torch.float32, device=x.device)
    y = torch.empty(rows.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    bounds = routing.offsets.tolist()
    for e in range(w13.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            gate, up = F.linear(rows[lo:hi], w13[e].float()).chunk(2, dim=-1)
            act[lo:hi] = F.silu(gate) * up
            # the kernel's down GEMM reads act as stored: rounded to the activation dtype
            y[lo:hi] = F.linear(act[lo:hi].to(x.dtype).float(), w2[e].float())
    pairs = torch.empty_like(y)
    pairs[order] = y * routing.weights.reshape(-1)[order].float().unsqueeze(-1)
    return act, pairs, pairs.view(t, k, -1).sum(dim=1)
