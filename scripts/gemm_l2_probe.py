"""Are decode-sized GEMMs latency-bound or bytes-bound? cuBLAS on Qwen3-0.6B's four decoder shapes, per call in
CUDA graphs, with the weights cold (28 distinct copies, several times the L2), hot (one copy, L2-resident) and
prefetched (an l2_prefetch launch for the next product's weights ahead of each product), and a whole layer chain
(qkv, o, gate_up, down x 28 layers) cold against prefetched one and two products ahead.

    python scripts/gemm_l2_probe.py [--output results/gemm_l2_probe.jsonl]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from gemm_sweep import (  # scripts/ is on the path when run as a script
    LAYERS,
    SHAPES,
    decode_weights,
    emit,
)

from minillm.ops.build import load_extension
from minillm.diagnostics.kernel_check import _time_graph


def per_shape(m: int, weights: dict) -> dict:
    row = {}
    pf = torch.ops.minillm.l2_prefetch
    for name, (n, k) in SHAPES.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ws = weights[name]

        def us(fns) -> float:
            return round(_time_graph(fns) * 1000, 2)

        def prefetched(i, x=x, ws=ws):   # the next product's weights asked for, then this product
            return lambda: (pf([ws[(i + 1) % LAYERS]]), F.linear(x, ws[i]))

        row[f"{name}_cold_us"] = us([lambda w=w, x=x: F.linear(x, w) for w in ws])
        row[f"{name}_hot_us"] = us([lambda w=ws[0], x=x: F.linear(x, w) for _ in ws])
        row[f"{name}_pf1_us"] = us([prefetched(i) for i in range(LAYERS)])
        row[f"{name}_pf_only_us"] = us([lambda w=w: pf([w]) for w in ws])
    return row


def layer_chain(m: int, weights: dict) -> dict:
    """28 layers of the four products in order; prefetch `ahead` products ahead (0: none)."""
    pf = torch.ops.minillm.l2_prefetch
    xs = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for name, (n, k) in SHAPES.items()}
    seq = [(name, weights[name][layer]) for layer in range(LAYERS) for name in SHAPES]
    out = {}
    for ahead in (0, 1, 2):
        fns = []
        for i, (name, w) in enumerate(seq):
            nxt = seq[(i + ahead) % len(seq)][1]
            if ahead:
                fns.append(lambda x=xs[name], w=w, nxt=nxt: (pf([nxt]), F.linear(x, w)))
            else:
                fns.append(lambda x=xs[name], w=w: F.linear(x, w))
        out[f"chain_layer_us_ahead{ahead}"] = round(_time_graph(fns) * 1000 * len(SHAPES), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    load_extension()
    weights = decode_weights()
    for m in (1, 8, 32, 64, 128, 256):
        emit({"bench": "decode gemm vs L2 residency (cuBLAS)", "m": m, **per_shape(m, weights),
              **layer_chain(m, weights)}, args.output)


if __name__ == "__main__":
    main()
