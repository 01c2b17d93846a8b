"""Where a decode megakernel launch spends its time, from the kernel's own timeline stamps.

With a `profile` buffer (DecodeMegakernel.profile_buffer()), thread 0 of every CTA records (clock64, %globaltimer)
at 20 points of every layer (megakernel.h: kMegaProfPoints; POINTS below), each after the CTA barrier that ends
the step it marks, and once more after the final norm. From these:

- per CTA and layer, the time of each step between two points (clock64, converted with the CTA's own clock rate
  over the whole launch: exact within a CTA whatever %globaltimer's resolution);
- per grid barrier, across CTAs (%globaltimer): the spread of the arrivals (load imbalance: the last CTA against
  the median one) and the latency from the last arrival to the median CTA leaving (the barrier's own cost).

Every CTA spends the same time per layer (the barriers line them up), so the medians over CTAs of the steps add up
to the layer time, and the maxima show the CTAs on the critical path.
"""
from __future__ import annotations

import statistics

import torch

POINTS = ("qkv_start", "qkv_weights", "qkv_norm", "qkv_gemv", "qkv_arrive",
          "attn_start", "attn_arrive",
          "o_start", "o_weights", "o_gemv", "o_arrive",
          "gu_start", "gu_weights", "gu_norm", "gu_gemv", "gu_arrive",
          "down_start", "down_weights", "down_gemv", "down_arrive")
# The steps between consecutive points: (name, from point, to point); "barrier" steps end at the next phase's
# start, so they hold the wait at the grid barrier (the QKV one also issues the first attention item's loads).
STEPS = (("qkv.weights_wait", 0, 1), ("qkv.norm", 1, 2), ("qkv.gemv", 2, 3), ("qkv.epilogue", 3, 4),
         ("qkv.barrier", 4, 5),
         ("attn.items", 5, 6), ("attn.barrier", 6, 7),
         ("o.weights_wait", 7, 8), ("o.gemv", 8, 9), ("o.epilogue", 9, 10), ("o.barrier", 10, 11),
         ("gu.weights_wait", 11, 12), ("gu.norm", 12, 13), ("gu.gemv", 13, 14), ("gu.epilogue", 14, 15),
         ("gu.barrier", 15, 16),
         ("down.weights_wait", 16, 17), ("down.gemv", 17, 18), ("down.epilogue", 18, 19),
         ("down.barrier", 19, 20))   # point 20 = the next layer's qkv_start
BARRIERS = (("qkv", 4, 5), ("attn", 6, 7), ("o", 10, 11), ("gu", 15, 16), ("down", 19, 20))


def split_stamps(buf: torch.Tensor, num_layers: int, num_ctas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(clock, ns): int64 [num_layers + 1, len(POINTS) + 1, num_ctas] each. Point len(POINTS) of layer l is
    point 0 of layer l + 1; row num_layers holds the final stamp (after the final norm) at point 0."""
    p = len(POINTS)
    raw = buf.detach().to("cpu", torch.int64).view(-1)
    need = (num_layers * p + 1) * num_ctas * 2
    if raw.numel() < need:
        raise ValueError(f"timeline buffer has {raw.numel()} words, {need} needed")
    pairs = raw[:need].view(num_layers * p + 1, num_ctas, 2)
    out = torch.zeros(2, num_layers + 1, p + 1, num_ctas, dtype=torch.int64)
    body = pairs[: num_layers * p].view(num_layers, p, num_ctas, 2).permute(3, 0, 1, 2)
    out[:, :num_layers, :p] = body
    out[:, : num_layers - 1, p] = body[:, 1:, 0]
    out[:, num_layers - 1, p] = pairs[num_layers * p].permute(1, 0)   # after the last layer: the final stamp
    out[:, num_layers, 0] = pairs[num_layers * p].permute(1, 0)
    return out[0], out[1]


def analyze(buf: torch.Tensor, num_layers: int, num_ctas: int, skip_first: int = 1) -> dict:
    """Per-step and per-barrier costs in microseconds, averaged over layers skip_first..num_layers-2 (the first
    layer waits for its weights from a cold start; the last layer's down barrier step holds the final norm)."""
    if num_layers < skip_first + 2:
        raise ValueError(f"need at least {skip_first + 2} layers, got {num_layers}")
    clk, ns = split_stamps(buf, num_layers, num_ctas)
    span_clk = (clk[num_layers, 0] - clk[0, 0]).double()
    span_ns = (ns[num_layers, 0] - ns[0, 0]).double()
    if bool((span_ns <= 0).any()) or bool((span_clk <= 0).any()):
        raise ValueError("timeline stamps are not increasing (was the buffer written by a launch?)")
    rate = span_clk / span_ns                                   # cycles per ns, per CTA
    layers = range(skip_first, num_layers - 1)
    steps = {}
    for name, a, b in STEPS:
        per_layer = [((clk[l, b] - clk[l, a]).double() / rate) / 1e3 for l in layers]   # us, [num_ctas] each
        steps[name] = dict(median_us=_mean(float(x.median()) for x in per_layer),
                           max_us=_mean(float(x.max()) for x in per_layer))
    barriers = {}
    for name, a, b in BARRIERS:
        imb, lat = [], []
        for l in layers:
            arrive, leave = ns[l, a].double(), ns[l, b].double()
            imb.append(float(arrive.max() - arrive.median()) / 1e3)
            lat.append(float(leave.median() - arrive.max()) / 1e3)
        barriers[name] = dict(imbalance_us=_mean(imb), latency_us=_mean(lat))
    layer_us = [float((ns[l + 1, 0] - ns[l, 0]).double().median()) / 1e3 for l in layers]
    res = [float(x) for x in torch.diff(torch.unique(ns[:num_layers].flatten())).tolist()[:10000]]
    return dict(layer_us=_mean(layer_us), launch_us=float(span_ns.median()) / 1e3,
                clock_ghz=float(rate.median()), globaltimer_step_ns=min(res) if res else 0.0,
                steps=steps, barriers=barriers, layers_averaged=len(layer_us))


def phase_totals(summary: dict) -> dict:
    """The median step times summed per phase (qkv, attn, o, gu, down): they add up to layer_us."""
    out: dict[str, float] = {}
    for name, v in summary["steps"].items():
        phase = name.split(".")[0]
        out[phase] = out.get(phase, 0.0) + v["median_us"]
    return out


def format_summary(summary: dict, title: str = "") -> str:
    lines = [f"{title} layer {summary['layer_us']:.2f} us (launch {summary['launch_us']:.1f} us, "
             f"{summary['layers_averaged']} layers averaged, SM clock {summary['clock_ghz']:.2f} GHz)",
             f"{'step':<20}{'median us':>10}{'max us':>9}"]
    for name, v in summary["steps"].items():
        lines.append(f"{name:<20}{v['median_us']:>10.2f}{v['max_us']:>9.2f}")
    lines.append(f"{'barrier':<20}{'imbalance':>10}{'latency':>9}")
    for name, v in summary["barriers"].items():
        lines.append(f"{name:<20}{v['imbalance_us']:>10.2f}{v['latency_us']:>9.2f}")
    return "\n".join(lines)


def _mean(xs) -> float:
    xs = list(xs)
    return statistics.fmean(xs) if xs else 0.0


# Figure categories: every step falls in one (the barrier steps hold the wait for the slowest CTA).
CATEGORIES = (("norm", "norm"), ("weights_wait", "weights wait"), ("gemv", "GEMV"), ("epilogue", "epilogue"),
              ("items", "attention items"), ("barrier", "grid barrier wait"))


def category_totals(summary: dict) -> dict[str, float]:
    """Median step times summed by kind of step (CATEGORIES), in us per layer."""
    out = {label: 0.0 for _, label in CATEGORIES}
    for name, v in summary["steps"].items():
        kind = name.split(".")[1]
        out[dict(CATEGORIES)[kind]] += v["median_us"]
    return out


def plot_timelines(lines: list[dict], path, weight_floor_us: float | None = None) -> None:
    """One stacked bar per (batch, context) of the newest timeline lines: us per layer by kind of step, with the
    layer's weight-bytes floor as a vertical line when given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    newest: dict[tuple[int, int], dict] = {}
    for line in sorted((ln for ln in lines if ln.get("kind") == "timeline"), key=lambda ln: ln.get("date", "")):
        newest[(line["batch"], line["context"])] = line
    if not newest:
        raise ValueError("no timeline lines to plot")
    keys = sorted(newest)
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(keys) + 2.2))
    left = [0.0] * len(keys)
    for i, (_, label) in enumerate(CATEGORIES):
        widths = [category_totals(newest[k])[label] for k in keys]
        ax.barh(range(len(keys)), widths, left=left, color=f"C{i}", label=label)
        left = [a + b for a, b in zip(left, widths)]
    if weight_floor_us:
        ax.axvline(weight_floor_us, color="k", linestyle="--", label="weight bytes at copy bandwidth")
    ax.set_yticks(range(len(keys)), [f"B={b}, ctx {c}" for b, c in keys])
    ax.invert_yaxis()
    ax.set_xlabel("us per decoder layer (median CTA)")
    last = newest[keys[-1]]
    gpu = (last.get("fingerprint") or {}).get("gpu") or "?"
    ax.set_title(f"decode megakernel, one layer by step, {gpu}, commit {last.get('commit', '?')}, "
                 f"{last.get('date', '?')[:10]}", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
