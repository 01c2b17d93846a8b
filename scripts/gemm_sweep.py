"""Decode-shape GEMMs: cuBLAS (F.linear) vs the skinny GEMM vs the decode GEMM, per call in CUDA graphs.

    python scripts/gemm_sweep.py [--output results/gemm_sweep.jsonl] [--rows 1 8 16 ...] [--models 0.6b 8b]
    python scripts/gemm_sweep.py --quick     # M in 1, 8, 16, 32, 64 on the Qwen3-0.6B and -8B shapes, < 1 minute

Each shape gets distinct weights (28 for Qwen3-0.6B, as many as put 4x the L2 in rotation for the 8B ones), timed
as check-kernels times its kernels: CUDA-graph replays of the products back to back, as a decode step runs them.
One line per (shape, M, implementation, mode):
  mode "alone": the products back to back, us per product;
  mode "after_norm": each product right behind an RMSNorm kernel that writes its x, captured with programmatic
    dependent launch on (minillm's kernels take part; cuBLAS does not): us per product = (pair - norm alone).
    This is where the decode GEMM's weight loads, issued before its griddepcontrol.wait, show.
Fields: us, weight_tbps (weight bytes / us); for the skinny GEMM its K split; for the decode GEMM its config
[splits, row_warps] from choose_config with the model's prediction, the best config found by timing (every
legal one; --quick: the 8 the model ranks first), and the max abs difference from an fp32 F.linear. A summary
table (decode vs cuBLAS, alone and after the norm) ends the output. GPU (sm_90) only.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from minillm.fingerprint import stamp
from minillm.ops import decode_gemm as dg
from minillm.ops import gemm_ops
from minillm.ops.fused_ops import MAX_NORM_HIDDEN
from minillm.ops.build import load_extension
from minillm.diagnostics.kernel_check import _time_graph
from minillm.ops.launch import pdl_launches

MODELS = {  # (N, K) of each layer GEMM
    "0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)},
}
LAYERS = 28
ROWS = (1, 2, 4, 8, 16, 32, 48, 64)
QUICK_ROWS = (1, 8, 16, 32, 64)
QUICK_SEARCH = 8


def _us(fns, pdl: bool = False) -> float:
    with pdl_launches(pdl):
        return _time_graph(fns) * 1000


def implementations(m: int, n: int, k: int, sms: int, skinny: bool) -> dict:
    """name -> (gemm(x, w), extra fields) for the implementations that can run this shape."""
    ops = torch.ops.minillm
    impls = {"cublas": (F.linear, {})}
    if skinny and n % gemm_ops.TILE_N == 0 and k % gemm_ops.TILE_K == 0:
        s = gemm_ops.gemm_splits(m, n, k, sms)
        impls["skinny"] = (lambda x, w, s=s: ops.skinny_gemm(x, w, s), {"splits": s})
    if dg.covers(m, n, k, torch.bfloat16, 9) is None:
        c = dg.choose_config(m, n, k, sms)
        impls["decode"] = (lambda x, w, c=c: ops.decode_gemm(x, w, *c),
                           {"config": list(c), "model_us": round(dg.model_us(m, n, k, *c, sms), 2)})
    return impls


def best_config(m: int, x, ws: list, sms: int, quick: bool) -> tuple[float, tuple[int, int]]:
    n, k = ws[0].shape
    cands = sorted(dg.configs(k), key=lambda c: dg.model_us(m, n, k, *c, sms))
    if quick:
        cands = cands[:QUICK_SEARCH]
    return min((_us([lambda w=w, c=c: torch.ops.minillm.decode_gemm(x, w, *c) for w in ws]), c) for c in cands)


def shape_lines(name: str, m: int, ws: list, sms: int, quick: bool) -> list[dict]:
    n, k = ws[0].shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    norm = torch.ops.minillm.rms_norm
    # the RMSNorm kernel takes rows of up to MAX_NORM_HIDDEN: wider inputs (Qwen3-8B's down, K = 12288) are timed alone
    norm_us = _us([lambda: norm(x, norm_w, 1e-6) for _ in ws], pdl=True) if k <= MAX_NORM_HIDDEN else None
    weight_bytes = n * k * ws[0].element_size()
    lines = []
    for impl, (gemm, extra) in implementations(m, n, k, sms, skinny=not quick).items():
        modes = [("alone", _us([lambda w=w: gemm(x, w) for w in ws]))]
        if norm_us is not None:
            pair = _us([lambda w=w: gemm(norm(x, norm_w, 1e-6), w) for w in ws], pdl=True)
            modes.append(("after_norm", pair - norm_us))
        for mode, us in modes:
            line = {"name": name, "n": n, "k": k, "m": m, "dtype": "bfloat16", "impl": impl, "mode": mode,
                    "us": round(us, 2), "weight_tbps": round(weight_bytes / us / 1e6, 3), "weights": len(ws),
                    **extra}
            if mode == "after_norm":
                line["norm_us"] = round(norm_us, 2)
            lines.append(line)
        if impl == "decode":
            best_us, best_c = best_config(m, x, ws, sms, quick)
            ref = F.linear(x.float(), ws[0].float())
            y = gemm(x, ws[0]).float()
            lines[-len(modes)].update(best_us=round(best_us, 2), best_config=list(best_c),
                             max_abs_diff=(y - ref).abs().max().item(), finite=bool(torch.isfinite(y).all()))
    return lines


def decode_weights(model: str) -> dict:
    """Distinct bf16 weights per shape: 28 (one per layer), fewer where 4x the L2 is reached sooner."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
    out = {}
    for name, (n, k) in MODELS[model].items():
        count = min(LAYERS, max(2, -(-4 * l2 // (n * k * 2))))
        out[name] = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
    return out


def emit(row: dict, output: str | None) -> None:
    """Print a result line; append it with the GPU fingerprint and commit to `output` when given."""
    print(json.dumps(row), flush=True)
    if output:
        with open(output, "a") as f:
            f.write(json.dumps({**row, **stamp()}) + "\n")


def summary(rows: list[dict]) -> str:
    """One line per (model, shape, M): decode and cuBLAS us alone, decode after the norm, best config."""
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["name"], r["m"]), {})[(r["impl"], r["mode"])] = r
    out = ["model shape    M | cublas  decode  x     | decode after norm | TB/s  | config best(us)"]
    for (model, name, m), d in by.items():
        cb, de, dp = d.get(("cublas", "alone")), d.get(("decode", "alone")), d.get(("decode", "after_norm"))
        if not (cb and de):
            continue
        after = f"{dp['us']:6.2f}" if dp else "     -"
        out.append(f"{model:5} {name:8} {m:3} | {cb['us']:6.2f}  {de['us']:6.2f}  {cb['us'] / de['us']:4.2f}x | "
                   f"{after}            | {de['weight_tbps']:5.2f} | {de['config']} "
                   f"{de['best_config']}({de['best_us']})")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=None)
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None)
    ap.add_argument("--quick", action="store_true", help="M in 1, 8, 16, 32, 64 on both models, no skinny GEMM, "
                                                         "a short config search")
    args = ap.parse_args()
    rows_m = args.rows or (QUICK_ROWS if args.quick else ROWS)
    models = args.models or (["0.6b", "8b"] if args.quick else ["0.6b"])
    load_extension()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for model in models:
        weights = decode_weights(model)
        for m in rows_m:
            for name in MODELS[model]:
                for line in shape_lines(name, m, weights[name], sms, args.quick):
                    row = {"bench": "decode gemm", "model": model, **line}
                    results.append(row)
                    emit(row, args.output)
        del weights
        torch.cuda.empty_cache()
    print(summary(results), flush=True)


if __name__ == "__main__":
    main()
