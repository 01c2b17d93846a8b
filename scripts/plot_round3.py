#!/usr/bin/env python3
"""Figures of the round-3 kernel benchmarks from their results lines (the newest commit in each file):
results/prefill_kernels.png (TFLOP/s against prompt length, per kernel and head shape),
results/moe_kernels.png (MoE layer time against tokens, fused kernels against torch._grouped_mm) and
results/decode_steps_models.png (the decode sweep, one curve per model at its newest commit: ms per step with its
bandwidth floor, and % of that floor, against the batch size) and results/structured_cost.png (the cost of
B=64 with every row constrained, worker process and GPU wait, run by run, and against the GPU's wait for the
mask). decode_steps.png, which `minillm bench --decode-sweep` redraws after each sweep, compares one model's
newest two commits instead.

Usage: python scripts/plot_round3.py [--results results]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm.bench.decode_sweep import line_model  # noqa: E402


def newest(path: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("kind") == kind]
    last = rows[-1]["commit"] if rows else None
    return [r for r in rows if r["commit"] == last]


def plot_prefill(rows: list[dict], out: Path) -> None:
    series = defaultdict(list)
    for r in rows:
        if r["ctx"] == r["q_len"]:   # whole prompts; the chunk-over-prefix rows are in the table
            series[(r["model_shape"], r["impl"])].append((r["ctx"], r["tflops"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (shape, impl), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{impl} ({shape} heads)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens (causal, head dim 128)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"Prefill attention on the H200 (commit {rows[0]['commit']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def plot_moe(rows: list[dict], out: Path) -> None:
    series = defaultdict(list)
    for r in rows:
        series[r["impl"]].append((r["tokens"], r["layer_us"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for impl, pts in sorted(series.items()):
        pts.sort()
        label = "fused kernels" if impl == "fused" else "torch._grouped_mm"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in the step")
    ax.set_ylabel("us per MoE layer")
    ax.set_title(f"Qwen3-30B-A3B MoE layer on the H200 (commit {rows[0]['commit']})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def newest_per_model(path: Path) -> dict[str, dict[int, dict]]:
    """model -> batch size -> line, from each model's newest commit (its newest line per batch size)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = sorted((r for r in rows if r.get("kind") == "decode_step"), key=lambda r: r.get("date", ""))
    by_model: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_model[line_model(r)].append(r)
    out = {}
    for model, lines in by_model.items():
        commit = lines[-1]["commit"]
        out[model] = {r["batch_size"]: r for r in lines if r["commit"] == commit}
    return out


def plot_decode_models(models: dict[str, dict[int, dict]], out: Path) -> None:
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    lines = [ln for pts in models.values() for ln in pts.values()]
    fig, (ms_ax, pct_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, (model, pts) in enumerate(sorted(models.items())):
        xs = sorted(pts)
        commit, color = pts[xs[0]]["commit"], f"C{i}"
        ms_ax.plot(xs, [pts[x]["ms_per_step"] for x in xs], "o-", color=color, label=f"{model} ({commit})")
        ms_ax.plot(xs, [pts[x]["floor_ms"] for x in xs], "--", color=color, label=f"{model} bandwidth floor")
        pct_ax.plot(xs, [100 * pts[x]["fraction_of_floor"] for x in xs], "o-", color=color,
                    label=f"{model} ({commit})")
    batches = sorted({b for pts in models.values() for b in pts})
    for ax in (ms_ax, pct_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size (decode rows per step)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ms_ax.set_yscale("log")
    ms_ax.set_ylim(top=4 * max(ln["ms_per_step"] for ln in lines))   # room for the legend above the curves
    ms_ax.set_yticks([t for t in (0.2, 0.3, 0.5, 1, 2, 3, 5, 10, 20, 30, 50, 100)
                      if min(ln["floor_ms"] for ln in lines) / 1.5 <= t <= 4 * max(ln["ms_per_step"] for ln in lines)])
    ms_ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ms_ax.yaxis.set_minor_formatter(NullFormatter())
    ms_ax.set_ylabel("ms per decode step")
    pct_ax.set_ylim(0, 100)
    pct_ax.set_ylabel("% of the bandwidth floor (floor / measured)")
    setups = {(ln["dtype"].removeprefix("torch."), ln["config"]["model"]["load_format"], ln["prompt_len"],
               ln["out_tokens"], (ln.get("fingerprint") or {}).get("gpu") or "no GPU") for ln in lines}
    title = "; ".join(f"{d}, {w} weights, {p}-token prompts, {n} tokens, {g}" for d, w, p, n, g in sorted(setups))
    fig.suptitle(f"Decode step against batch size ({title})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def structured_runs(path: Path) -> list[dict]:
    """Every B=64 all-constrained line with the matchers in the worker and the stream waiting for the mask, in
    the order the runs started."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    runs = [r for r in rows if r.get("kind") == "structured_overhead" and r.get("label") == "B64-all"
            and r.get("mask_worker") and r.get("mask_wait") == "auto" and not r.get("serial_masks")
            and "gpu_mask_stall_ms_median" in r]
    return sorted(runs, key=lambda r: r.get("date", ""))   # run order: an A/B's two trees alternate


def _setting(r: dict) -> str:
    parts = [] if r.get("mask_threads", 1) == 1 else [f"{r['mask_threads']} fill thr"]
    if r.get("mask_workers", 1) != 1:
        parts.append(f"{r['mask_workers']} workers")
    if r.get("host_threads") == 1:
        parts.append("1 host thr")
    return ", ".join(parts)


def _rings(r: dict) -> bool:
    """Whether the run's tree hands steady steps to the worker through shared memory (its bench times the ring)."""
    return "masks_ring" in r.get("host_parts_ms_per_step", {})


def plot_structured(rows: list[dict], out: Path) -> None:
    cost = [100 * r["overhead_vs_unconstrained"] for r in rows]
    stall = [r["gpu_mask_stall_ms_median"] for r in rows]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4.2), gridspec_kw={"width_ratios": [1.8, 1, 1]})
    bars = a.bar(range(len(rows)), cost, color=["tab:green" if c <= 5 else "tab:red" for c in cost])
    for bar, r in zip(bars, rows):
        if not r.get("rounds"):   # one pass, unconstrained first (and slower while the process warms up)
            bar.set_hatch("//")
            bar.set_alpha(0.5)
    a.axhline(5, color="k", ls="--", lw=1, label="target 5%; hatched: one pass, not interleaved rounds")
    a.set_xticks(range(len(rows)), [f"{r['commit']} {_setting(r)}" for r in rows], rotation=90, fontsize=5)
    a.set_ylabel("B=64 all constrained, % over unconstrained")
    a.set_title("Structured outputs: cost per run (H200, in run order)", fontsize=9)
    a.legend(fontsize=7)
    b.scatter(stall, cost, s=14)
    b.axhline(5, color="k", ls="--", lw=1)
    b.set_xlabel("GPU wait for the mask, ms per step (median)")
    b.set_ylabel("% over unconstrained")
    b.set_title("Until c6c3bb3 the cost followed the wait", fontsize=9)
    for ring, color, label in ((False, "tab:purple", "fill handed over each step"),
                               (True, "tab:green", "steady steps ring the worker (32f0121 on)")):
        busy = [(r["host_busy_ms_per_step"], x) for r, x in zip(rows, cost)
                if "host_busy_ms_per_step" in r and _rings(r) == ring]
        c.scatter([h for h, _ in busy], [x for _, x in busy], s=14, color=color, label=label)
    c.axhline(5, color="k", ls="--", lw=1)
    c.set_xlabel("engine thread busy, ms per step")
    c.set_title("Since: the host's own time decides", fontsize=9)
    c.legend(fontsize=7)
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=Path("results"))
    args = ap.parse_args()
    plot_prefill(newest(args.results / "prefill_kernels.jsonl", "prefill_kernel"), args.results / "prefill_kernels.png")
    plot_moe(newest(args.results / "moe_kernels.jsonl", "moe_layer"), args.results / "moe_kernels.png")
    plot_decode_models(newest_per_model(args.results / "decode_steps.jsonl"), args.results / "decode_steps_models.png")
    plot_structured(structured_runs(args.results / "structured.jsonl"), args.results / "structured_cost.png")


if __name__ == "__main__":
    main()
