"""Where the time of a whole `minillm bench` run goes: the offline workload once timed, once under torch.profiler.

    python scripts/profile_bench.py [--model qwen3-0.6b|tiny] [--set section.key=value ...] [--num-requests N]
                                    [--workload FILE.yaml] [--top 30] [--output profile_bench.json]

The engine is built exactly as `minillm bench` builds it (configs/bench.yaml's engine, then --set, then --model),
warmed up the same way, and then:
  pass A: one un-profiled timed pass, with the engine's host StepProfile attached, as the bench does: wall A,
          output tok/s, fraction of the hardware floor, host phases;
  pass B: the same workload, salted so it misses the prefix cache pass A filled, under torch.profiler (device
          activity only on CUDA): wall B (inflated by the profiler), and the device kernels by category, GPU
          busy/idle time and the top kernels (minillm/bench/kernel_profile.py), plus the decode attention
          bandwidth inside the run.
Writes one JSON object (--output) and prints a short summary. `--model tiny` runs the embedded demo model; without
CUDA everything runs on the CPU (aten:: ops instead of kernels), for a smoke test.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from minillm.bench.floor import floor_record, measure_device
from minillm.bench.kernel_profile import summarize_profile
from minillm.bench.offline import build_llm, floor_work, free_device_memory, timed_pass, warm_up
from minillm.bench.suite import BENCH_SUITE, device_of, label, offline_workload, prepare_device, read_suite
from minillm.bench.suite import build_config as suite_config
from minillm.engine.profile import StepProfile
from minillm.fingerprint import stamp


def build_config(args, max_model_len: int):
    """The bench's EngineConfig: suite engine, then --set, then --model ('tiny' = the demo model, model=None)."""
    sets = list(args.set)
    model = args.model
    if model == "tiny":
        sets.append("model.model=null")
        model = None
    return suite_config(read_suite(args.suite), None, sets, {"model": model}, {}, max_model_len)


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def pass_a(llm, w, progress: bool) -> tuple[float, int, dict]:
    """The timed pass, as `minillm bench` times it. Returns (wall s, preemptions, StepProfile summary)."""
    llm.engine.profile = host = StepProfile()
    wall, tokens, preempted = timed_pass(llm, w, progress)
    llm.engine.profile = None
    if tokens != w.output_tokens:
        raise RuntimeError(f"pass A produced {tokens} output tokens, the workload asks for {w.output_tokens}")
    return wall, preempted, host.summary()


def pass_b(llm, w, cuda: bool, top: int) -> tuple[float, dict]:
    """The profiled pass over the salted workload. Returns (wall s, kernel summary). A StepProfile counts the
    steps for the per-step figures (its own cost is a few perf_counter calls per step). Device activity only on
    CUDA (less profiler overhead); an engine on the CPU needs the CPU ops."""
    llm.engine.profile = steps = StepProfile()
    sync(cuda)
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        wall, tokens, _ = timed_pass(llm, w.salted(1), False)
        sync(cuda)
    llm.engine.profile = None
    if tokens != w.output_tokens:
        raise RuntimeError(f"pass B produced {tokens} output tokens, the workload asks for {w.output_tokens}")
    return wall, summarize_profile(prof, wall_ms=1e3 * wall, steps=steps.steps, top=top)


def decode_attention_bandwidth(kv_bytes: int, kernels: dict, copy_bytes_per_s: float | None) -> dict:
    """Bytes/s the decode attention kernels achieved inside the run: the floor's KV bytes over their kernel time.

    NOTE: approximate. The floor's kv_bytes counts the context read of every output token, but each request's
    first output token comes from its prefill step (read by the prefill kernel), so the decode kernels read about
    one token's context per request less than kv_bytes; the figure is that much too high."""
    ms = kernels["by_category_ms"].get("decode attention", 0.0)
    bw = kv_bytes / (ms / 1e3) if ms > 0 else None
    frac = bw / copy_bytes_per_s if bw and copy_bytes_per_s else None
    return {"kv_bytes": kv_bytes, "kernel_ms": ms, "bytes_per_s": bw, "fraction_of_copy_bandwidth": frac}


def run(args, w, cfg) -> dict:
    dev = device_of(cfg)
    extra = prepare_device(dev)
    rates = measure_device(dev)   # before the engine takes the GPU memory, as the bench does
    llm, load_s = build_llm(cfg)
    try:
        warmup_s = warm_up(llm, w)
        wall_a, preemptions, host = pass_a(llm, w, args.progress)
        wall_b, kernels = pass_b(llm, w, dev.startswith("cuda"), args.top)
        work, dtype = floor_work(llm, w, cfg.scheduler.max_num_seqs)
    finally:
        del llm
        free_device_memory()
    floor = floor_record(work, rates, wall_a)
    return {"kind": "profile_bench", "label": label(cfg), "config": dataclasses.asdict(cfg), "dtype": dtype,
            "device": dev, "workload": w.summary(), "load_s": load_s, "warmup_s": warmup_s, **extra,
            "wall_a_s": wall_a, "wall_b_s": wall_b, "output_tok_s": w.output_tokens / wall_a,
            "preemptions": preemptions, "floor": floor, "step_profile": host, "kernels": kernels,
            "decode_attention": decode_attention_bandwidth(work.kv_bytes, kernels, rates.copy_bytes_per_s),
            **stamp()}


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def print_summary(res: dict) -> None:
    k, d, f = res["kernels"], res["decode_attention"], res["floor"]
    asy = " async" if res["config"]["runtime"]["async_scheduling"] else ""
    print(f"{res['label']}{asy} on {res['device']} ({res['dtype']}), {res['workload']['num_requests']} requests: "
          f"wall A {res['wall_a_s']:.3f} s ({res['output_tok_s']:,.0f} output tok/s, "
          f"{_pct(f['fraction_of_floor'])} of floor), wall B (profiled) {res['wall_b_s']:.3f} s")
    print(f"pass B [{k['source']}]: busy {k['busy_ms']:.1f} ms ({_pct(k['busy_fraction'])} of wall B), "
          f"idle {k['idle_ms']:.1f} ms, kernel sum {k['kernel_sum_ms']:.1f} ms, {k['steps']} steps")
    g = k["idle_gaps"]
    print(f"  idle between kernels by tenth of the trace (ms): {[round(x, 1) for x in g['idle_by_slice_ms']]}; "
          f"{g['long_gaps']} gaps over {g['long_gap_us']:g} us hold {g['long_gap_ms']:.1f} ms")
    print(f"  idle by gap size (ms): { {k: round(v, 1) for k, v in g['idle_by_gap_size_ms'].items()} }")
    for cat, ms in k["by_category_ms"].items():
        share = ms / k["kernel_sum_ms"] if k["kernel_sum_ms"] else None
        print(f"  {cat:<18} {ms:10.1f} ms  {_pct(share):>6}")
    bw = "-" if d["bytes_per_s"] is None else f"{d['bytes_per_s'] / 1e9:,.0f} GB/s"
    print(f"decode attention: {bw} ({_pct(d['fraction_of_copy_bandwidth'])} of the copy bandwidth)")
    for kern in k["top_kernels"][:10]:
        print(f"  {kern['total_ms']:10.1f} ms {kern['calls']:8d} calls  {kern['name'][:100]}")
    phases = res["step_profile"]["ms_per_step"]
    print("pass A host phases (ms/step):", {p: round(v, 3) for p, v in phases.items()})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="preset or checkpoint (default: the suite's); 'tiny' = demo model")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="engine override, as for `minillm bench --set` (repeatable)")
    ap.add_argument("--num-requests", type=int, default=None, help="run only the first N requests")
    ap.add_argument("--workload", type=Path, default=None, help="workload YAML instead of the offline reference")
    ap.add_argument("--suite", type=Path, default=BENCH_SUITE, help="suite whose engine section is the base")
    ap.add_argument("--top", type=int, default=30, help="kernels listed by total time")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--output", type=Path, default=Path("profile_bench.json"))
    args = ap.parse_args(argv)
    try:
        w = offline_workload(args.workload, args.num_requests)
        cfg = build_config(args, w.max_model_len)
    except ValueError as e:   # ConfigError and workload errors: a message, not a traceback
        sys.exit(f"profile_bench: error: {e}")
    res = run(args, w, cfg)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(res, indent=1))   # before printing: a closed pipe cannot lose it
    print_summary(res)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
