"""Where the GPU's time goes in a torch.profiler trace: device kernels by category, busy and idle time.

Only device activity is counted: kernels, memcpys and memsets (FunctionEvent.device_type == CUDA). A trace also
holds CPU ops (aten::linear, aten::mm, aten::copy_, ...) whose *device* time is the same kernels again, attributed
to every op up the call stack; summing device time over `key_averages()` therefore counts a GEMM two or three
times. Here each kernel is counted once, from its own start and end.

Busy time is the length of the union of the kernel intervals, not their sum: kernels on different streams (or a
memcpy next to a kernel) may overlap, and the sum would then exceed the time the device was actually occupied.

Without CUDA (a CPU smoke run) there are no device events; `summarize_profile` falls back to the aten:: ops on
the CPU, each with its *self* time, so a nested op (aten::linear -> aten::addmm) is not counted twice either.

All times are in milliseconds.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

# First match wins, so the order matters: "paged_decode" must be decode attention before "attention" (prefill)
# could claim it, "copy" must not claim a GEMM's splitK reduction, and the MoE expert GEMMs (torch._grouped_mm's
# CUTLASS kernels, "...GemmUniversal<cutlass::gemm::GroupProblemShape...") must be "moe experts" before "gemm"
# could claim them. Substrings are matched case-insensitively. The aten:: names are for the CPU fallback.
# NOTE: the pure-PyTorch attention path runs decode through SDPA too, so there it is counted as "prefill
# attention"; the torch MoE path routes with stock softmax/topk/sort kernels, counted as "sampler" and "other"
# (minillm's fused routing kernel is "moe routing"); the router's own [T, H] x [H, E] linear is a "gemm", except
# where moe_route_gemv computes it inside the routing.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("moe routing", ("moe_topk", "moe_group", "moe_route")),
    ("moe experts", ("moe_gate_up", "moe_down", "moe_combine", "grouped_mm", "groupproblemshape")),
    ("decode attention", ("paged_decode", "decode_reduce")),
    ("prefill attention", ("paged_prefill", "flash", "sdpa", "scaled_dot_product", "attention", "fmha")),
    ("kv write", ("kv_write",)),
    ("gemm", ("nvjet", "gemm", "cutlass", "cublas", "splitkreduce", "xmma", "addmm", "matmul", "aten::mm",
              "aten::bmm", "aten::linear")),
    ("norm/rope/act", ("rms", "rope", "silu")),
    ("sampler", ("race", "sample", "argmax", "softmax", "exponential")),
    ("copy", ("memcpy", "memset", "copy", "fill", "index", "gather", "cat")),
)
OTHER = "other"

# Kineto activity types (libkineto ActivityType names) that are real device work. A "gpu_user_annotation" (a
# record_function range drawn on the GPU timeline, recorded with the CPU activity) also carries device_type CUDA,
# but it spans kernels already counted and would double them. FunctionEvent.activity_type is recent (absent in
# torch 2.11); there, `is_user_annotation` is what tells such a range apart.
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def category(name: str) -> str:
    """The coarse category of a kernel (or aten op) name; "other" when no substring matches."""
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), OTHER)


@dataclass(frozen=True)
class Span:
    """One unit of device work: its interval (us, trace clock) and the time it is charged (us).
    For a kernel the charge is end - start; for a CPU op in the fallback it is the op's self time."""
    name: str
    start_us: float
    end_us: float
    charge_us: float


def merged_runs(intervals) -> list[tuple[float, float]]:
    """(start, end) intervals merged where they overlap or touch, in time order: the device's busy runs."""
    runs: list[list[float]] = []
    for start, end in sorted(intervals):
        if runs and start <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([start, end])
    return [(a, b) for a, b in runs]


def union_length(intervals) -> float:
    """Total length covered by (start, end) intervals: how long the device had at least one kernel running."""
    return sum(end - start for start, end in merged_runs(intervals))


GAP_BUCKETS_US = (2.0, 5.0, 20.0, 50.0)   # upper edges of the gap-size buckets; the last bucket is open


def idle_gaps(intervals, parts: int = 10, long_us: float = 50.0) -> dict:
    """Where the idle time between busy runs sits: the gaps longer than `long_us` (count and ms), the idle ms in
    each of `parts` equal slices of the trace (a gap is charged to the slice its start falls in), and the idle
    ms by gap size (GAP_BUCKETS_US). Idle piled up in the last slices points at the small batches at the end of
    an offline run; spread evenly, at a per-step host cost; in gaps of a few us, at kernel-to-kernel launch
    latency."""
    labels = [f"<{b:g}us" for b in GAP_BUCKETS_US] + [f">={GAP_BUCKETS_US[-1]:g}us"]
    by_size = dict.fromkeys(labels, 0.0)
    runs = merged_runs(intervals)
    if len(runs) < 2:
        return {"long_gap_us": long_us, "long_gaps": 0, "long_gap_ms": 0.0, "idle_by_slice_ms": [0.0] * parts,
                "idle_by_gap_size_ms": by_size}
    t0, t1 = runs[0][0], runs[-1][1]
    width = (t1 - t0) / parts
    by_slice = [0.0] * parts
    long_n, long_total = 0, 0.0
    for (_, prev_end), (start, _) in zip(runs, runs[1:]):
        gap = start - prev_end
        by_slice[min(parts - 1, int((prev_end - t0) / width))] += gap / 1e3
        by_size[labels[sum(gap >= b for b in GAP_BUCKETS_US)]] += gap / 1e3
        if gap > long_us:
            long_n, long_total = long_n + 1, long_total + gap
    return {"long_gap_us": long_us, "long_gaps": long_n, "long_gap_ms": long_total / 1e3,
            "idle_by_slice_ms": by_slice, "idle_by_gap_size_ms": by_size}


def _is_device_work(e) -> bool:
    """A kernel, memcpy or memset: on the device, not an annotation range, and of a device-work activity type
    where the event carries one (older torch: judged by the first two alone)."""
    from torch.autograd import DeviceType

    kind = getattr(e, "activity_type", None)
    return (e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
            and (not kind or kind in DEVICE_WORK))


def device_spans(prof) -> list[Span]:
    """Every device kernel/memcpy/memset of a finished profile, each once (never the CPU ops that launched it)."""
    return [Span(e.name, e.time_range.start, e.time_range.end, e.time_range.end - e.time_range.start)
            for e in prof.events() if _is_device_work(e)]


def cpu_op_spans(prof) -> list[Span]:
    """The CPU fallback: aten:: ops charged their self time (children excluded, so nesting is not counted
    twice); their intervals still nest, which the union in `summarize` handles."""
    from torch.autograd import DeviceType

    return [Span(e.name, e.time_range.start, e.time_range.end, e.self_cpu_time_total)
            for e in prof.events() if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]


def _top(spans: list[Span], n: int) -> list[dict]:
    """The n names with the most charged time, with call counts."""
    total, calls = defaultdict(float), defaultdict(int)
    for s in spans:
        total[s.name] += s.charge_us
        calls[s.name] += 1
    names = sorted(total, key=lambda k: -total[k])[:n]
    return [{"name": k, "category": category(k), "calls": calls[k], "total_ms": total[k] / 1e3,
             "mean_us": total[k] / calls[k]} for k in names]


def _per_step(summary: dict, steps: int) -> dict:
    """The additive figures divided by the step count (ms per step)."""
    keys = ("busy_ms", "idle_ms", "kernel_sum_ms", "window_ms")
    out = {k: summary[k] / steps for k in keys}
    out["by_category_ms"] = {c: ms / steps for c, ms in summary["by_category_ms"].items()}
    return out


def summarize(spans: list[Span], *, wall_ms: float | None = None, steps: int | None = None, top: int = 25,
              source: str = "device kernels") -> dict:
    """Busy (union of intervals), idle (window - busy), kernel sum, per-category sums and the top kernels.

    The window is `wall_ms` when given (the timed region the trace covers), else the span from the first kernel's
    start to the last kernel's end. With `steps`, a "per_step" block divides the additive figures by it."""
    busy = union_length((s.start_us, s.end_us) for s in spans) / 1e3
    span = (max(s.end_us for s in spans) - min(s.start_us for s in spans)) / 1e3 if spans else 0.0
    window = span if wall_ms is None else wall_ms
    by_cat = defaultdict(float)
    for s in spans:
        by_cat[category(s.name)] += s.charge_us / 1e3
    out = {"source": source, "num_events": len(spans), "span_ms": span, "wall_ms": wall_ms, "window_ms": window,
           "busy_ms": busy, "idle_ms": window - busy, "busy_fraction": busy / window if window > 0 else None,
           "kernel_sum_ms": sum(s.charge_us for s in spans) / 1e3,
           "by_category_ms": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
           "top_kernels": _top(spans, top), "steps": steps,
           "idle_gaps": idle_gaps((s.start_us, s.end_us) for s in spans)}
    out["per_step"] = _per_step(out, steps) if steps else None
    return out


def summarize_profile(prof, *, wall_ms: float | None = None, steps: int | None = None, top: int = 25) -> dict:
    """`summarize` over a finished torch.profiler.profile: its device work, or its aten:: CPU ops when the trace
    holds no device events (no CUDA, or the CUDA activity was not recorded)."""
    spans = device_spans(prof)
    if spans:
        return summarize(spans, wall_ms=wall_ms, steps=steps, top=top, source="device kernels")
    return summarize(cpu_op_spans(prof), wall_ms=wall_ms, steps=steps, top=top, source="cpu aten ops")
