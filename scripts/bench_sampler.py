#!/usr/bin/env python3
"""Sampler time per call on the GPU at a Qwen3 vocab (151,936), bf16 logits as the lm_head gives them.

Rows, per batch size B:
  plain       temperature 0.7 only (the one-pass race kernel);
  top_p       temperature 0.7, top_p 0.9 (the serve defaults), Sampler(cuda=True): fp32 copy / T, the threshold
              kernel, the race kernel with the threshold;
  top_p_sort  the same batch on the torch path's sort (Sampler(cuda=False)), what top-p cost before the kernel;
  threshold   the threshold op alone (sampling_ops.truncation_threshold, fp32 logits after temperature), and
  threshold_sort its torch path.
Each: median over --iters calls of the time between two CUDA events around one call, after warm-up calls. The
calls are eager (the torch path's generator noise is not graph-captured here), so launch gaps between a call's
kernels count, as they do in an eager step. Logits rotate over enough copies to exceed the L2, as a decode step's
fresh lm_head output would. One JSON line per (B, row) to --out.

Usage: python scripts/bench_sampler.py --out results/bench_sampler.jsonl [--batches 1,8,64,256] [--iters 50]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm.fingerprint import stamp  # noqa: E402
from minillm.ops.build import load_extension  # noqa: E402
from minillm.ops.sampling_ops import truncation_threshold, truncation_threshold_torch  # noqa: E402
from minillm.request import Request  # noqa: E402
from minillm.sampling.batch import SamplingBatch  # noqa: E402
from minillm.sampling.sampler import Sampler  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402

VOCAB = 151936
L2_BYTES = 60 << 20


def _batch(b: int, **params) -> SamplingBatch:
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8, **params)) for i in range(b)]
    return SamplingBatch.build(requests, "cuda", VOCAB)


def _median_ms(fn, inputs: list, iters: int, warmup: int = 5) -> float:
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        x = inputs[i % len(inputs)]
        start.record()
        fn(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run(b: int, iters: int) -> list[dict]:
    copies = max(2, -(-L2_BYTES // (b * VOCAB * 2)))
    gen = torch.Generator(device="cuda").manual_seed(b)
    logits = [(torch.randn(b, VOCAB, generator=gen, device="cuda") * 3).bfloat16() for _ in range(copies)]
    plain, top_p = _batch(b, temperature=0.7), _batch(b, temperature=0.7, top_p=0.9)
    kernel, sort = Sampler(0, cuda=True), Sampler(0, cuda=False)
    scaled = [x.float() / 0.7 for x in logits[:2]]   # the threshold alone: after temperature, as the sampler has it
    args = (top_p.top_k, top_p.top_p, top_p.min_p, top_p.max_top_k)
    cases = {
        "plain": lambda x: kernel(x, plain),
        "top_p": lambda x: kernel(x, top_p),
        "top_p_sort": lambda x: sort(x, top_p),
        "threshold": lambda x: truncation_threshold(x, *args, cuda=True),
        "threshold_sort": lambda x: truncation_threshold_torch(x, *args),
    }
    rows = []
    for name, fn in cases.items():
        inputs = scaled if name.startswith("threshold") else logits
        ms = _median_ms(fn, inputs, iters)
        rows.append(dict(bench="sampler", case=name, batch=b, vocab=VOCAB, ms=ms))
        print(f"B={b:4d} {name:15s} {ms * 1e3:9.1f} us", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    load_extension()
    base = stamp()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("a") as f:
        for b in (int(v) for v in a.batches.split(",")):
            for row in run(b, a.iters):
                f.write(json.dumps({**row, **base}) + "\n")


if __name__ == "__main__":
    main()
