"""Decode-shape GEMMs of Qwen3-0.6B: cuBLAS (F.linear) vs the skinny GEMM kernel, per call inside CUDA graphs.

    python scripts/gemm_sweep.py [--output results/gemm_sweep.jsonl]

Each shape gets 28 distinct weights (one per layer, 8-12 MB each, so the set is several times the L2), timed as
check-kernels times its kernels: CUDA-graph replays of the 28 products back to back, as a decode step runs them. One line per batch size M: microseconds per call
of each implementation, the kernel at its automatic K split and at its best split, and its max abs difference
from cuBLAS. GPU (sm_90) only; this is what set gemm_ops.MAX_ROWS and MAX_N.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from minillm.fingerprint import stamp
from minillm.ops import gemm_ops
from minillm.ops.build import load_extension
from minillm.diagnostics.kernel_check import _time_graph

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}   # (N, K)
LAYERS = 28


def sweep_row(m: int, weights: dict, sms: int) -> dict:
    row = {"m": m}
    for name, (n, k) in SHAPES.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ws = weights[name]

        def us(gemm) -> float:   # per call, one call per layer's weight in each graph pass
            return _time_graph([lambda w=w: gemm(x, w) for w in ws]) * 1000

        def skinny(splits):
            return lambda x_, w_: torch.ops.minillm.skinny_gemm(x_, w_, splits)
        auto = gemm_ops.gemm_splits(m, n, k, sms)
        row[f"{name}_cublas_us"] = round(us(F.linear), 2)
        row[f"{name}_skinny_us"] = round(us(skinny(auto)), 2)
        row[f"{name}_splits"] = auto
        best = min((us(skinny(s)), s) for s in (1, 2, 4, 8) if k % (s * gemm_ops.TILE_K) == 0)
        row[f"{name}_best_us"], row[f"{name}_best_splits"] = round(best[0], 2), best[1]
        diff = torch.ops.minillm.skinny_gemm(x, ws[0], auto).float() - F.linear(x, ws[0]).float()
        row[f"{name}_max_abs_diff"] = diff.abs().max().item()
    return row


def decode_weights() -> dict:
    """LAYERS distinct bf16 weights per shape (several times the L2 together)."""
    return {name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
            for name, (n, k) in SHAPES.items()}


def emit(row: dict, output: str | None) -> None:
    """Print a result line; append it with the GPU fingerprint and commit to `output` when given."""
    print(json.dumps(row), flush=True)
    if output:
        with open(output, "a") as f:
            f.write(json.dumps({**row, **stamp()}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    load_extension()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights = decode_weights()
    for m in (1, 8, 16, 32, 64, 128, 192, 256):
        emit({"bench": "decode gemm, 28 weights per shape", **sweep_row(m, weights, sms)}, args.output)


if __name__ == "__main__":
    main()
