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
Fused CUDA routing / grouped-GEMM kernels would plug in behind these same two entry points.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minillm.ops.fused_ops import silu_and_mul


@dataclass(frozen=True)
class Routing:
    """Which experts each token uses, and the expert-sorted order of the (token, slot) pairs."""
    weights: torch.Tensor    # [T, k], the activation dtype (HF casts the fp32 probabilities back)
    experts: torch.Tensor    # [T, k] int64 expert ids
    order: torch.Tensor      # [T * k] int64: flat pair index (token * k + slot), sorted by expert, stable
    counts: torch.Tensor     # [E] int32 pairs routed to each expert
    offsets: torch.Tensor    # [E + 1] int32: expert e's rows are order[offsets[e]:offsets[e + 1]]


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          weight_dtype: torch.dtype | None = None) -> Routing:
    """Softmax in fp32 over the experts, the top-k of it, renormalised to sum 1 when `renormalize`
    (norm_topk_prob), then the per-expert counts and offsets. router_logits [T, E]; the routing weights are
    returned in weight_dtype (default: the logits' dtype)."""
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
