#!/usr/bin/env python3
"""Paged prefill attention: the minillm kernels (attention_ops.PREFILL_KERNELS) against torch SDPA on contiguous
K/V and the engine's cuDNN route over the paged cache (attention_ops.prefill_cudnn, K/V read back included),
single sequences, causal, bf16, head dim 128, block size 16, random block table.

Shapes: Qwen3-0.6B (16 query / 8 KV heads) and Qwen3-8B (32 / 8), whole prompts of --lengths tokens, plus chunks
over a cached prefix: 1,024 queries over 7,168 tokens, 2,048 over 2,048 and over 14,336, and 16,384 over 16,384
(a 32k prompt's second chunk under the default 16,384-token budget). Per impl: median ms over CUDA-graph replays
(minillm/diagnostics/kernel_check.py: prefill_timings), TFLOP/s of the causal work (QK^T and PV: 4 H D per
(query, visible key) pair; 2*2*T*T*D*H/2 to leading order), the ratio to SDPA and the max abs difference to SDPA.
Prints a table and appends one JSON line per (shape, kernel) to --out, with the commit and GPU fingerprint: the
kernels the engine runs on this GPU (kernel_check.engine_kernels), SDPA and the cuDNN route first, then the other
kernels this GPU runs (wgmma1 on sm_90) in a pass of their own.

Usage: python scripts/prefill_bench.py [--out results/prefill_kernels.jsonl] [--lengths 1024,2048,4096,8192,16384,32768]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm.diagnostics.kernel_check import _finite, _print_timings, engine_kernels, prefill_timings  # noqa: E402
from minillm.ops import attention_ops as ops  # noqa: E402
from minillm.fingerprint import stamp  # noqa: E402

SHAPES = {"qwen3-0.6b": (16, 8), "qwen3-8b": (32, 8)}   # query heads, KV heads (head dim 128 both)
CHUNKS = [(8192, 1024), (4096, 2048), (16384, 2048), (32768, 16384)]   # context, queries: chunks over a prefix


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/prefill_kernels.jsonl"))
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768", help="comma-separated prompt lengths")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",") if x]
    if not lengths or any(t <= 0 for t in lengths):
        ap.error("--lengths must be positive integers")

    import torch

    if not torch.cuda.is_available():
        print("prefill_bench: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from minillm.ops.build import load_extension

    load_extension()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # The engine's kernels and SDPA first, written before the others run: a fault there cannot lose them.
    engine = engine_kernels()
    passes = [(engine, True)]
    opt_in = tuple(k for k in ops.prefill_kernels_on(torch.cuda.get_device_capability()) if k not in engine)
    if opt_in:
        passes.append((opt_in, False))
    for kernels, sdpa_too in passes:
        rows = []
        for model, (hq, hkv) in SHAPES.items():
            for ctx, q_len in [(t, None) for t in lengths] + CHUNKS:
                for r in prefill_timings(ctx, q_len, hq=hq, hkv=hkv, kernels=kernels, sdpa_too=sdpa_too):
                    rows.append({"model_shape": model, "ctx": ctx, "q_len": q_len or ctx, **r})
                torch.cuda.empty_cache()
        _print_timings(rows)
        base = stamp()
        with args.out.open("a") as f:
            for r in rows:
                f.write(json.dumps({"kind": "prefill_kernel", **_finite(r), **base}) + "\n")
        print(f"appended {len(rows)} lines to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
