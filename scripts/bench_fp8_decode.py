"""The paged decode kernel over an fp8 KV cache against bf16: us per call and TB/s of the bytes each one reads.

    python scripts/bench_fp8_decode.py [--output results/kv_fp8_decode.jsonl] [--batches 64 256]
                                       [--ctx 1024 4096] [--caches bfloat16 fp8 fp8_e5m2]

Qwen3-0.6B attention (16 query / 8 KV heads, head dim 128, block size 16), every sequence at the same context,
blocks in random order, inputs rotated so the working set is several times the L2, timed as CUDA-graph replays
(minillm/diagnostics/kv_quant_check.py:run_fp8_timings, the check-kernels recipe), with the dispatcher's
partitioning. One JSON line per (batch, context, cache) is printed and appended to --output with the commit and
GPU fingerprint; a table of the fp8 speed-up over bf16 ends the output. Defaults: 4 shapes x 2 caches, well under
a minute on an H200 once the extension is built.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's minillm, not an installed one

from minillm.diagnostics.kv_quant_check import run_fp8_timings  # noqa: E402
from minillm.fingerprint import stamp  # noqa: E402
from minillm.ops.build import load_extension  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", default="results/kv_fp8_decode.jsonl")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--caches", nargs="+", default=["bfloat16", "fp8"])
    args = ap.parse_args()
    load_extension()
    base = {"kind": "fp8_decode_timing", **stamp()}
    rows = []
    with open(args.output, "a") as f:
        for batch in args.batches:
            for ctx in args.ctx:
                for r in run_fp8_timings(batch, ctx, caches=tuple(args.caches)):
                    r = {**r, "batch": batch, "ctx": ctx}
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                    f.write(json.dumps({**r, **base}) + "\n")
    print(f"{'shape':42} {'cache':22} {'us':>8} {'TB/s':>6} {'vs bf16':>8}")
    for r in rows:
        bf16 = next((x for x in rows if x["bench"] == r["bench"] and x["impl"] == "minillm bfloat16 cache"), None)
        speed = f"{bf16['us'] / r['us']:.2f}x" if bf16 else ""
        print(f"{r['bench']:42} {r['impl']:22} {r['us']:8.1f} {r['tb_s']:6.2f} {speed:>8}")


if __name__ == "__main__":
    main()
