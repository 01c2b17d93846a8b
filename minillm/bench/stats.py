"""Latency statistics from per-token timestamps: TTFT and inter-token latency percentiles."""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default).
    None for an empty sample, so a config that produced no tokens shows as missing, not as zero latency."""
    if not 0 <= q <= 100:
        raise ValueError(f"q={q!r} is not allowed: a percentile in [0, 100]")
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class RequestTimeline:
    """When a request arrived (the time it was due, not when the driver got round to adding it) and when each of
    its output tokens became visible to the caller."""
    arrival: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def worst_gaps(timelines: list[RequestTimeline], n: int = 3) -> list[list[float]]:
    """The n largest inter-token gaps as [gap seconds, seconds from the first arrival to the gap's end]: a stall
    at the start of a run points at first-use costs (kernel loading, allocation), one later at the work itself."""
    if not timelines:
        return []
    t0 = min(t.arrival for t in timelines)
    gaps = ((b - a, b - t0) for t in timelines for a, b in zip(t.token_times, t.token_times[1:]))
    return [list(g) for g in heapq.nlargest(n, gaps)]


def latency_summary(timelines: list[RequestTimeline]) -> dict:
    """TTFT p50/p99, ITL p50/p99/max (seconds), the worst ITL gaps and when they ended, and output tokens per
    second over the whole run (first arrival to last token)."""
    ttfts = [t.ttft for t in timelines if t.ttft is not None]
    itls = [x for t in timelines for x in t.itls]
    tokens = sum(len(t.token_times) for t in timelines)
    ends = [t.token_times[-1] for t in timelines if t.token_times]
    span = max(ends) - min(t.arrival for t in timelines) if ends else 0.0
    return {"ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),
            "itl_mean_s": sum(itls) / len(itls) if itls else None,
            "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
            "itl_max_s": max(itls) if itls else None, "itl_worst_s": worst_gaps(timelines),
            "output_tokens": tokens,
            "output_tok_s": tokens / span if span > 0 else None}
