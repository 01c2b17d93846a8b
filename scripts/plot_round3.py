#!/usr/bin/env python3
"""Figures of the round-3 kernel benchmarks from their results lines (the newest commit in each file):
results/prefill_kernels.png (TFLOP/s against prompt length, per kernel and head shape) and
results/moe_kernels.png (MoE layer time against tokens, fused kernels against torch._grouped_mm).

Usage: python scripts/plot_round3.py [--results results]
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=Path("results"))
    args = ap.parse_args()
    plot_prefill(newest(args.results / "prefill_kernels.jsonl", "prefill_kernel"), args.results / "prefill_kernels.png")
    plot_moe(newest(args.results / "moe_kernels.jsonl", "moe_layer"), args.results / "moe_kernels.png")


if __name__ == "__main__":
    main()
