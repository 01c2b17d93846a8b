"""Decode-shape GEMMs of Qwen3-0.6B: cuBLAS (F.linear) vs the skinny GEMM vs the decode GEMM, per call in CUDA graphs.

    python scripts/gemm_sweep.py [--output results/gemm_sweep.jsonl] [--rows 1 8 16 ...]

Each shape gets 28 distinct weights (one per layer, 8-12 MB each, so the set is several times the L2), timed as
check-kernels times its kernels: CUDA-graph replays of the 28 products back to back, as a decode step runs them.
One line per (shape, M, implementation, mode):
  mode "alone": the 28 products back to back, us per product;
  mode "after_norm": each product right behind an RMSNorm kernel that writes its x, captured with programmatic
    dependent launch on (minillm's kernels take part; cuBLAS does not): us per product = (pair - norm alone).
    This is where the decode GEMM's weight prologue, issued before its griddepcontrol.wait, shows.
Fields: us, weight_tbps (weight bytes / us), for the skinny and decode GEMMs their K split; for the decode GEMM
also its best split over 1..8 (to check decode_gemm.choose_splits' model) and the max abs difference from an fp32
F.linear. GPU (sm_90) only.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from minillm.fingerprint import stamp
from minillm.ops import decode_gemm as dg
from minillm.ops import gemm_ops
from minillm.ops.build import load_extension
from minillm.diagnostics.kernel_check import _time_graph
from minillm.ops.launch import pdl_launches

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}   # (N, K)
LAYERS = 28
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256)


def _us(fns, pdl: bool = False) -> float:
    with pdl_launches(pdl):
        return _time_graph(fns) * 1000


def implementations(m: int, n: int, k: int, sms: int) -> dict:
    """name -> (gemm(x, w), extra fields) for the implementations that can run this shape."""
    ops = torch.ops.minillm
    impls = {"cublas": (F.linear, {})}
    if n % gemm_ops.TILE_N == 0 and k % gemm_ops.TILE_K == 0:
        s = gemm_ops.gemm_splits(m, n, k, sms)
        impls["skinny"] = (lambda x, w, s=s: ops.skinny_gemm(x, w, s), {"splits": s})
    if dg.covers(m, n, k, torch.bfloat16, 9) is None:
        s = dg.choose_splits(m, n, k, sms)
        impls["decode"] = (lambda x, w, s=s: ops.decode_gemm(x, w, s), {"splits": s})
    return impls


def shape_lines(name: str, m: int, ws: list, sms: int) -> list[dict]:
    n, k = ws[0].shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    norm = torch.ops.minillm.rms_norm
    norm_us = _us([lambda: norm(x, norm_w, 1e-6) for _ in ws], pdl=True)
    weight_bytes = n * k * ws[0].element_size()
    lines = []
    for impl, (gemm, extra) in implementations(m, n, k, sms).items():
        alone = _us([lambda w=w: gemm(x, w) for w in ws])
        pair = _us([lambda w=w: gemm(norm(x, norm_w, 1e-6), w) for w in ws], pdl=True)
        for mode, us in (("alone", alone), ("after_norm", pair - norm_us)):
            line = {"name": name, "n": n, "k": k, "m": m, "dtype": "bfloat16", "impl": impl, "mode": mode,
                    "us": round(us, 2), "weight_tbps": round(weight_bytes / us / 1e6, 3), **extra}
            if mode == "after_norm":
                line["norm_us"] = round(norm_us, 2)
            lines.append(line)
        if impl == "decode":
            best = min((_us([lambda w=w, s=s: torch.ops.minillm.decode_gemm(x, w, s) for w in ws]), s)
                       for s in range(1, min(dg.MAX_SPLITS, k // dg.TILE_K) + 1))
            ref = F.linear(x.float(), ws[0].float())
            y = gemm(x, ws[0]).float()
            lines[-2].update(best_us=round(best[0], 2), best_splits=best[1],
                             max_abs_diff=(y - ref).abs().max().item(), finite=bool(torch.isfinite(y).all()))
    return lines


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
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    args = ap.parse_args()
    load_extension()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights = decode_weights()
    for m in args.rows:
        for name in SHAPES:
            for line in shape_lines(name, m, weights[name], sms):
                emit({"bench": "decode gemm, 28 weights per shape", **line}, args.output)


if __name__ == "__main__":
    main()
