"""Where a steady-state decode step's time goes: torch.profiler over N engine steps at a fixed batch/context.

    python scripts/profile_decode.py [--model qwen3-0.6b] [--batch 256] [--context 1024] [--steps 20]
                                     [--async-scheduling] [--output profile.json]

Prints the kernels by total device time (with a coarse category: attention, GEMM, norm/rope/act, sampler,
copy, other), device time per step against wall time per step (the gap is GPU idle: host work and launch
gaps), and the engine's host-phase profile. On a CPU it runs too (tiny model), for a smoke test.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from minillm import LLM, SamplingParams
from minillm.engine.profile import StepProfile

CATEGORIES = (("attention", ("paged", "decode", "prefill", "kv_write", "flash", "attention")),
              ("gemm", ("gemm", "sm90", "cutlass", "cublas", "nvjet", "matmul", "addmm", "linear")),
              ("norm/rope/act", ("rms", "rope", "silu", "norm")),
              ("sampler", ("sample", "race", "argmax", "exponential", "softmax")),
              ("copy", ("copy", "memcpy", "memset", "fill", "index")))


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def build(args) -> LLM:
    kw = dict(max_model_len=args.context + args.steps + 64, max_num_seqs=args.batch,
              async_scheduling=args.async_scheduling)
    if args.model in (None, "tiny"):
        return LLM(None, device="cpu", **kw)
    return LLM(args.model, load_format="dummy", **kw)


def run(args) -> dict:
    llm = build(args)
    rng = random.Random(0)
    sp = SamplingParams(temperature=0.6, max_tokens=args.steps + 8, ignore_eos=True)
    vocab = llm.model_arch.vocab_size
    for _ in range(args.batch):
        llm.add_request([rng.randrange(min(vocab, 10000)) for _ in range(args.context)], sp)
    started = set()
    while len(started) < args.batch:            # prefill everything (and a step more for async scheduling)
        started.update(o.request_id for o in llm.step() if o.new_token_ids)
    for _ in range(3):
        llm.step()
    llm.engine.profile = prof = StepProfile()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=activities) as p:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            llm.step()
        sync()
        wall = time.perf_counter() - t0
    use_device = torch.cuda.is_available()
    kernels = defaultdict(float)
    for e in p.key_averages():
        t = e.device_time_total if use_device else e.self_cpu_time_total
        if t > 0 and (use_device or e.key.startswith("aten::")):
            kernels[e.key] += t / 1e3 / args.steps           # ms per step
    by_cat = defaultdict(float)
    for name, ms in kernels.items():
        by_cat[category(name)] += ms
    busy = sum(kernels.values())
    return {"batch": args.batch, "context": args.context, "steps": args.steps, "device": str(llm.device),
            "async_scheduling": args.async_scheduling, "wall_ms_per_step": 1e3 * wall / args.steps,
            "device_ms_per_step": busy, "by_category_ms": dict(by_cat),
            "top_kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:25]),
            "host_phases": prof.summary()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b", help="preset (dummy weights) or 'tiny' (demo model, CPU)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--output", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    res = run(args)
    if args.output:   # first, so that a reader closing the pipe early cannot lose it
        with open(args.output, "w") as f:
            json.dump(res, f, indent=1)
    print(f"{res['device']}: batch {res['batch']}, context {res['context']}, async {res['async_scheduling']}: "
          f"wall {res['wall_ms_per_step']:.3f} ms/step, device busy {res['device_ms_per_step']:.3f} ms/step")
    for cat, ms in sorted(res["by_category_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {cat:<14} {ms:8.3f} ms/step")
    for name, ms in res["top_kernels_ms"].items():
        print(f"    {ms:8.3f}  {name[:110]}")
    print("  host phases (ms/step):", {k: round(v, 3) for k, v in res["host_phases"]["ms_per_step"].items()})


if __name__ == "__main__":
    main()
