"""Where a steady-state decode step's time goes: torch.profiler over N engine steps at a fixed batch/context.

    python scripts/profile_decode.py [--model qwen3-0.6b|qwen3-30b-a3b|DIR] [--batch 256] [--context 1024] [--steps 20]
                                     [--async-scheduling] [--output profile.json]

Runs the N steps twice: first un-profiled, for the wall time per step (the profiler's own host overhead slows
every step down), then under torch.profiler. From the trace it reports the device kernels (each counted once, see
minillm/bench/kernel_profile.py) by category and by name, and the GPU busy time (union of kernel intervals) and
idle time per step. Also the engine's host-phase profile of the un-profiled steps. On a CPU it runs too (tiny
model, aten:: ops instead of kernels), for a smoke test.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minillm import LLM, SamplingParams
from minillm.bench.kernel_profile import summarize_profile
from minillm.engine.profile import StepProfile

WARM_STEPS = 3


def build(args) -> LLM:
    kw = dict(max_model_len=args.context + 2 * args.steps + WARM_STEPS + 64, max_num_seqs=args.batch,
              async_scheduling=args.async_scheduling)
    if args.model in (None, "tiny"):
        return LLM(None, device="cpu", **kw)
    return LLM(args.model, load_format="dummy", **kw)


def fill_batch(llm: LLM, args) -> None:
    """Add the batch, prefill it all (a step more for async scheduling), then a few decode steps.
    max_tokens leaves room for both timed runs, so no request finishes and the batch stays full."""
    rng = random.Random(0)
    sp = SamplingParams(temperature=0.6, max_tokens=2 * args.steps + WARM_STEPS + 8, ignore_eos=True)
    vocab = llm.model_arch.vocab_size
    for _ in range(args.batch):
        llm.add_request([rng.randrange(min(vocab, 10000)) for _ in range(args.context)], sp)
    started = set()
    while len(started) < args.batch:
        started.update(o.request_id for o in llm.step() if o.new_token_ids)
    for _ in range(WARM_STEPS):
        llm.step()


def timed_steps(llm: LLM, steps: int, sync) -> float:
    """Seconds for `steps` engine steps, the device drained before and after."""
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.step()
    sync()
    return time.perf_counter() - t0


def run(args) -> dict:
    llm = build(args)
    fill_batch(llm, args)
    cuda = torch.device(llm.device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    llm.engine.profile = host = StepProfile()
    wall = timed_steps(llm, args.steps, sync)            # un-profiled: the wall figure to trust
    llm.engine.profile = None
    # Device activity only on CUDA (less profiler overhead); the CPU fallback needs the CPU ops.
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as p:
        wall_profiled = timed_steps(llm, args.steps, sync)
    k = summarize_profile(p, wall_ms=1e3 * wall_profiled, steps=args.steps)
    per = k["per_step"]
    return {"batch": args.batch, "context": args.context, "steps": args.steps, "device": str(llm.device),
            "async_scheduling": args.async_scheduling, "source": k["source"],
            "wall_ms_per_step": 1e3 * wall / args.steps,
            "profiled_wall_ms_per_step": 1e3 * wall_profiled / args.steps,
            "busy_ms_per_step": per["busy_ms"],
            "idle_ms_per_step": per["idle_ms"],                 # profiled wall - busy, from the trace
            "idle_est_ms_per_step": 1e3 * wall / args.steps - per["busy_ms"],   # un-profiled wall - busy
            "kernel_sum_ms_per_step": per["kernel_sum_ms"],
            "by_category_ms": per["by_category_ms"],
            "kernels": k,                                       # the whole trace: totals, top kernels
            "host_phases": host.summary()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b",
                    help="preset or checkpoint directory (dummy weights either way), or 'tiny' (demo model, CPU)")
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
          f"wall {res['wall_ms_per_step']:.3f} ms/step (profiled {res['profiled_wall_ms_per_step']:.3f}), "
          f"busy {res['busy_ms_per_step']:.3f}, idle {res['idle_ms_per_step']:.3f} in the trace "
          f"(~{res['idle_est_ms_per_step']:.3f} un-profiled), kernel sum {res['kernel_sum_ms_per_step']:.3f} "
          f"ms/step [{res['source']}]")
    for cat, ms in res["by_category_ms"].items():
        print(f"  {cat:<18} {ms:8.3f} ms/step")
    for kern in res["kernels"]["top_kernels"]:
        print(f"    {kern['total_ms'] / res['steps']:8.3f} ms/step {kern['calls']:6d} calls  {kern['name'][:100]}")
    print("  host phases (ms/step):", {k: round(v, 3) for k, v in res["host_phases"]["ms_per_step"].items()})


if __name__ == "__main__":
    main()
