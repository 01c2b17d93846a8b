"""Split-K policy sweep for the paged decode kernel on batches of mixed context lengths.

    python scripts/decode_policy_sweep.py [--output sweep.jsonl] [--quick]

The engine's decode batches are ragged (the offline reference has contexts of 100-2048 tokens in one
batch), while check-kernels times uniform contexts. This times v1, fixed split-K partition sizes and equal
split-K (-P: P partitions per sequence) on ragged batches of several sizes, as TB/s of K/V actually read, so
the dispatcher's choice can be set from a measurement. GPU only.
"""
from __future__ import annotations

import argparse
import json
import random

import torch

from minillm.fingerprint import stamp
from minillm.ops import attention_ops as ops
from minillm.diagnostics.kernel_check import _rotations, _time_graph


def ragged_case(batch: int, lo: int, hi: int, seed: int = 0, hq=16, hkv=8, d=128, bs=16):
    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(batch)]
    kv_bytes = sum(lens) * hkv * d * 2 * 2
    rot, width = _rotations(kv_bytes), -(-hi // bs)
    nb = rot * batch * width
    kc = torch.randn(nb, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.randperm(nb, device="cuda").to(torch.int32).view(rot, batch, width)
    q = torch.randn(rot, batch, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")

    def fns(part):
        return [lambda i=i: ops.paged_decode(out, q[i], kc, vc, bt[i], sl, d ** -0.5, hi, part) for i in range(rot)]
    return lens, kv_bytes, fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", default=None)
    ap.add_argument("--quick", action="store_true", help="only the bench's context range and the auto choice")
    args = ap.parse_args()
    rows = []
    ranges = ((100, 2048),) if args.quick else ((100, 2048), (1000, 1100), (100, 600))
    for lo, hi in ranges:
        for batch in (8, 16, 32, 64, 128, 256):
            lens, kv_bytes, fns = ragged_case(batch, lo, hi)
            auto = ops.decode_partition_size(batch, 8, hi)
            parts = (auto,) if args.quick else (0, 256, 512, -2, -3, -5, -9, -17)   # -P: P equal partitions
            for part in (p for p in parts if p < hi):
                ms = _time_graph(fns(part))
                rows.append(dict(bench=f"decode ragged B={batch} ctx=[{lo},{hi}]", partition=part,
                                 auto=part == auto, ms=ms, tb_s=kv_bytes / ms / 1e9))
                print(f"B={batch:4d} ctx=[{lo},{hi}] part={part:5d}{' (auto)' if part == auto else '       '} "
                      f"{ms * 1e3:8.1f} us {kv_bytes / ms / 1e9:6.2f} TB/s", flush=True)
    if args.output:
        with open(args.output, "a") as f:
            for r in rows:
                f.write(json.dumps({**r, **stamp()}) + "\n")


if __name__ == "__main__":
    main()
