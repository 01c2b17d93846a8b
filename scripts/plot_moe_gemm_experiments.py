#!/usr/bin/env python3
"""Figure of the MoE GEMM experiments that did not land (results/moe_gemm_experiments.jsonl) and of the weight-read
probe (results/weight_read_probe.jsonl): results/moe_gemm_experiments.png.

Left: each variant's fused MoE layer time (scripts/moe_bench.py) over the baseline timed in the same run, against
the token count (below 1: faster). Right: the probe's read rate per load scheme, for the 50 MB that Qwen3-30B-A3B's
gate_up reads at one token and for 400 MB (steady state).

    python scripts/plot_moe_gemm_experiments.py [--results results]
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (variant, its same-run baseline): commits as results lines name them
PAIRS = [("125a278", "79c4e70", "persistent walk"), ("1b3cb90", "f38bd70", "walk + L2::256B hint (vs walk)"),
         ("9b45205", "f38bd70", "walk + L2::128B hint (vs walk)"),
         ("0dadaeb", "0dadaeb-grid-per-item", "walk + 256B (vs a CTA per item + 256B)")]


def layer_us(rows: list[dict]) -> dict[str, dict[int, float]]:
    """commit -> tokens -> the mean fused layer time over that commit's lines."""
    acc = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("kind") == "moe_layer" and r.get("impl") == "fused":
            acc[r["commit"]][r["tokens"]].append(r["layer_us"])
    return {c: {t: sum(v) / len(v) for t, v in by.items()} for c, by in acc.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=Path("results"))
    args = ap.parse_args()
    rows = [json.loads(x) for x in (args.results / "moe_gemm_experiments.jsonl").read_text().splitlines() if x]
    probe = [json.loads(x) for x in (args.results / "weight_read_probe.jsonl").read_text().splitlines() if x]
    us = layer_us(rows)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
    for new, base, label in PAIRS:
        tokens = sorted(set(us.get(new, {})) & set(us.get(base, {})))
        ax.plot(tokens, [us[new][t] / us[base][t] for t in tokens], marker="o", label=f"{label} ({new})")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(xscale="log", xlabel="tokens in the step", ylabel="layer time / same-run baseline",
           title="Qwen3-30B-A3B MoE layer, fused kernels (H200)")
    ax.legend(fontsize=8)
    names = []
    for r in probe:
        name = r["scheme"] + (f" {r['chunk'] // 1024}K" if r["chunk"] else "")
        if name not in names:
            names.append(name)
    groups = sorted({(r["commit"], r["bytes"]) for r in probe})
    width = 0.8 / len(groups)
    for j, (commit, size) in enumerate(groups):
        rate = {r["scheme"] + (f" {r['chunk'] // 1024}K" if r["chunk"] else ""): r["tb_s"] for r in probe
                if (r["commit"], r["bytes"]) == (commit, size)}
        bx.bar([i + (j - (len(groups) - 1) / 2) * width for i in range(len(names))], [rate.get(n, 0) for n in names],
               width,
               label=f"{size >> 20} MiB ({commit})")
    bx.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
    bx.set(ylabel="TB/s", title="weight read rate by load scheme (weight_read_probe.cu)")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.results / "moe_gemm_experiments.png", dpi=120)


if __name__ == "__main__":
    main()
