#!/usr/bin/env python3
"""Decode step time, megakernel vs the existing path, Qwen3-0.6B shape with dummy weights (needs an sm_90 GPU).

For each batch size B and context length: (a) the engine's decode path as the runner runs it, captured in CUDA
graphs (minillm.runner.cuda_graphs.DecodeGraphs: ~300 kernels per step), and (b) the persistent decode kernel
(minillm.runner.cuda_graphs.MegakernelGraphs: one kernel per step). Both exclude the LM head and the sampler, which
are timed once on their own (common to both). Per step: median over many graph replays, each between two CUDA
events. Floor = (decoder weight bytes + KV bytes of every context token) / copy bandwidth measured in the run.
One correctness line per B: the hidden states of the two paths on the same step (context 128).

With --timeline: no timing of the two paths; instead the megakernel's own timeline stamps (one eager launch per
B and context after two warm-ups, minillm/bench/megakernel_timeline.py): the cost of every step of a layer and of
every grid barrier, printed and appended as kind="timeline" lines.

Usage: python scripts/megakernel_bench.py --out results/megakernel_bench.jsonl [--batches 1,2,4,8,16]
       [--contexts 128,512,2048] [--replays 200] [--timeline]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm.attention import make_attention_backend  # noqa: E402
from minillm.attention.metadata import AttentionMetadata  # noqa: E402
from minillm.bench.floor import measure_copy_bandwidth  # noqa: E402
from minillm.bench import megakernel_timeline  # noqa: E402
from minillm.config import EngineConfig  # noqa: E402
from minillm.fingerprint import stamp  # noqa: E402
from minillm.model.loader import load_model, resolve_arch  # noqa: E402
from minillm.ops.launch import pdl_launches  # noqa: E402
from minillm.ops import megakernel as mkops  # noqa: E402
from minillm.runner.cuda_graphs import DecodeGraphs, MegakernelGraphs  # noqa: E402
from minillm.runner.plan import DeviceInfo, resolve_plan  # noqa: E402
from minillm.cache.spec import KVCacheSpec  # noqa: E402


def median_replay_us(run, replays: int) -> float:
    """Median GPU time of run() (a graph replay), each bracketed by its own pair of events."""
    for _ in range(10):
        run()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)


class Step:
    """A decode step of B rows at one context length: each row owns ctx/bs random blocks; the new token
    (position ctx - 1) is written to its slot and attended to, every replay."""

    def __init__(self, b: int, ctx: int, bs: int, num_blocks: int, max_blocks: int, vocab: int, seed: int, dev):
        g = torch.Generator().manual_seed(seed)
        nb = -(-ctx // bs)
        perm = torch.randperm(num_blocks, generator=g)[: b * nb].view(b, nb).to(torch.int32)
        self.block_tables = torch.zeros(b, max_blocks, dtype=torch.int32)
        self.block_tables[:, :nb] = perm
        last = ctx - 1
        self.slots = (perm[:, last // bs].long() * bs + last % bs).to(dev)
        self.block_tables = self.block_tables.to(dev)
        self.seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        self.input_ids = torch.randint(0, vocab, (b,), generator=g).to(dev)
        self.positions = torch.full((b,), last, dtype=torch.int64, device=dev)
        self.meta = AttentionMetadata(num_seqs=b, num_decodes=b, num_tokens=b, max_query_len=1, max_seq_len=ctx,
                                      slot_mapping=self.slots,
                                      query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=dev),
                                      seq_lens=self.seq_lens, block_tables=self.block_tables, block_size=bs,
                                      query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=[ctx] * b)


def load_inputs(graphs, step: Step) -> None:
    """Copy a step into a graph set's static buffers (what replay() does before replaying)."""
    n, w = step.input_ids.shape[0], step.block_tables.shape[1]
    graphs.input_ids[:n].copy_(step.input_ids)
    graphs.positions[:n].copy_(step.positions)
    graphs.slot_mapping[:n].copy_(step.slots)
    graphs.seq_lens[:n].copy_(step.seq_lens)
    graphs.block_tables[:n, :w].copy_(step.block_tables)


def time_head(model, batches, replays: int) -> list[dict]:
    """LM head (+ the one-pass sampler where the extension has it), common to both paths, in a CUDA graph."""
    rows = []
    h = model.arch.hidden_size
    for b in batches:
        hidden = torch.randn(b, h, dtype=torch.bfloat16, device="cuda")
        inv_t = torch.full((b,), 1 / 0.6, device="cuda")
        has_sampler = hasattr(torch.ops.minillm, "sample_exponential_race")

        def head():
            logits = model.compute_logits(hidden, keep_dtype=True)
            if has_sampler:
                torch.ops.minillm.sample_exponential_race(logits, inv_t, 1, 0)
        head()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            head()
        rows.append(dict(kind="head", batch=b, us=median_replay_us(g.replay, replays),
                         what="lm_head + sample_exponential_race" if has_sampler else "lm_head"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--contexts", default="128,512,2048")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--megakernel-only", action="store_true",
                    help="no DecodeGraphs and no timing: two eager megakernel launches per batch and context (for ncu)")
    ap.add_argument("--min-chunks", type=int, default=mkops.MIN_PARTITION_CHUNKS,
                    help="smallest attention partition in 16-token chunks (kernels.megakernel_min_chunks)")
    ap.add_argument("--timeline", action="store_true", help="the megakernel's per-step timeline instead of timings")
    ap.add_argument("--schedules", default="ahead",
                    help="with --timeline: weight-issue schedules to stamp, comma-separated (ahead, serial; "
                         "DecodeMegakernel.forward)")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    dev, bs = torch.device("cuda"), args.block_size
    torch.manual_seed(0)
    t0 = time.time()
    cfg = EngineConfig.from_kwargs(args.model, dtype="bfloat16", block_size=bs, kernels="cuda", device="cuda")
    arch = resolve_arch(args.model, "dummy")
    plan = resolve_plan(cfg, arch, KVCacheSpec.for_model(arch, bs, "auto", torch.bfloat16), torch.bfloat16,
                        DeviceInfo.of(dev))
    backend = make_attention_backend(plan.attention_backend, min_partitions=plan.decode_min_partitions,
                                     ctas_per_sm=plan.decode_ctas_per_sm, fuse_kv_write=plan.fused_kv_write.on)
    model, arch, _ = load_model(args.model, "dummy", torch.bfloat16, dev, backend, seed=0,
                                kernels=plan.model_kernels())
    max_len = max(contexts) + bs
    max_blocks = -(-max_len // bs)
    num_blocks = max(batches) * max_blocks + 8
    kv_caches = KVCacheSpec.for_model(arch, bs, "auto", torch.bfloat16).allocate(num_blocks, dev)
    for k, v in kv_caches:   # finite, O(1) contents: timing does not depend on them
        k.normal_()
        v.normal_()
    bw = measure_copy_bandwidth(dev)
    print(f"model {args.model} loaded, KV cache {num_blocks} blocks, copy bandwidth {bw / 1e12:.2f} TB/s "
          f"({time.time() - t0:.1f} s)", flush=True)

    if args.timeline:
        return timelines(args, model, arch, kv_caches, batches, contexts, bs, num_blocks, max_blocks, max_len)
    if args.megakernel_only:
        return profile_launches(model, arch, kv_caches, batches, contexts, bs, num_blocks, max_blocks, max_len)
    dg = DecodeGraphs(model, kv_caches, max(batches), max_blocks, bs, max_len, arch.hidden_size, torch.bfloat16, dev)
    with pdl_launches(plan.pdl.on):   # the graph path's launch mode in the engine
        dg.capture()
    mk_batches = [b for b in batches if b <= mkops.MAX_BATCH]
    reason = mkops.unsupported_reason(arch, torch.bfloat16, bs, max(mk_batches or [1]), **mkops.device_limits(dev))
    mg = None
    if reason is None and mk_batches:
        mk = mkops.DecodeMegakernel(model, kv_caches, max(mk_batches), bs, max_len,
                                    min_partition_chunks=args.min_chunks)
        mg = MegakernelGraphs(mk, max_blocks)
        mg.capture(mk_batches)
    else:
        print(f"megakernel not applicable: {reason}", flush=True)
    print(f"graphs captured ({time.time() - t0:.1f} s)", flush=True)

    base, rows = stamp(), []
    for b in batches:
        for ctx in contexts:
            step = Step(b, ctx, bs, num_blocks, max_blocks, arch.vocab_size, seed=b * 7919 + ctx, dev=dev)
            nbytes = mkops.step_bytes(arch, [ctx] * b)
            floor = mkops.floor_us(nbytes["total_bytes"], bw)
            impls = [("decode_graphs", dg, dg.bucket(b))]
            if mg is not None and b in mg.graphs:
                impls.append(("megakernel", mg, b))
            for name, graphs, bucket in impls:
                load_inputs(graphs, step)
                if name == "decode_graphs" and bucket > b:
                    graphs.slot_mapping[b:bucket].fill_(-1)
                    graphs.seq_lens[b:bucket].fill_(1)
                us = median_replay_us(graphs.graphs[bucket].replay, args.replays)
                extra = {"min_chunks": args.min_chunks} if name == "megakernel" else {}
                rows.append(dict(kind="step", impl=name, batch=b, context=ctx, us_per_step=round(us, 2), **extra,
                                 floor_us=round(floor, 2), fraction_of_floor=round(floor / us, 3), **nbytes))
            if ctx == contexts[0] and mg is not None and b in mg.graphs:
                rows.append(correctness(dg, mg, step, b))
    rows += time_head(model, sorted({1, max(batches)}), args.replays)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for r in rows:
            f.write(json.dumps({**r, "model": args.model, "block_size": bs, "copy_bytes_per_s": bw, **base}) + "\n")
    print_table(rows, batches, contexts)
    return 0


@torch.no_grad()
def profile_launches(model, arch, kv_caches, batches, contexts, bs, num_blocks, max_blocks, max_len) -> int:
    """Eager megakernel launches only (under ncu: skip the first launch of each shape, it is the warm-up)."""
    mk = mkops.DecodeMegakernel(model, kv_caches, max(batches), bs, max_len)
    for b in batches:
        for ctx in contexts:
            step = Step(b, ctx, bs, num_blocks, max_blocks, arch.vocab_size, seed=b * 7919 + ctx, dev="cuda")
            for _ in range(2):
                mk.forward(step.input_ids, step.positions, step.meta)
            torch.cuda.synchronize()
            print(f"launched B={b} ctx={ctx}", flush=True)
    return 0


@torch.no_grad()
def timelines(args, model, arch, kv_caches, batches, contexts, bs, num_blocks, max_blocks, max_len) -> int:
    """One stamped launch per batch and context (after two warm-ups), analysed and appended to --out; the
    stamped variant's hidden states are checked bit-identical to the plain kernel's."""
    mk = mkops.DecodeMegakernel(model, kv_caches, max(batches), bs, max_len, min_partition_chunks=args.min_chunks)
    buf, base = mk.profile_buffer(), stamp()
    with args.out.open("a") as f:
        for b in batches:
            for ctx in contexts:
                step = Step(b, ctx, bs, num_blocks, max_blocks, arch.vocab_size, seed=b * 7919 + ctx, dev="cuda")
                plain = mk.forward(step.input_ids, step.positions, step.meta).clone()
                for sched in args.schedules.split(","):
                    for _ in range(3):
                        buf.zero_()
                        out = mk.forward(step.input_ids, step.positions, step.meta, profile=buf,
                                         schedule=sched)
                    torch.cuda.synchronize()
                    same = bool(torch.equal(out, plain))
                    s = megakernel_timeline.analyze(buf, arch.num_hidden_layers, mk.num_ctas)
                    label = f"B={b} ctx={ctx} schedule {sched}"
                    print(megakernel_timeline.format_summary(s, f"{label} (hidden states as without stamps: "
                                                                f"{same}):"), flush=True)
                    f.write(json.dumps({"kind": "timeline", "impl": "megakernel", "batch": b, "context": ctx,
                                        "schedule": sched, "identical_to_plain": same, **s,
                                        "phases_us": megakernel_timeline.phase_totals(s), "model": args.model,
                                        "block_size": bs, **base}) + "\n")
    return 0


@torch.no_grad()
def correctness(dg, mg, step: Step, b: int) -> dict:
    """Both paths on the same step (each writes the same new slot first): hidden states compared."""
    ref = dg.replay(step.input_ids, step.positions, step.meta).float().clone()
    got = mg.replay(step.input_ids, step.positions, step.meta).float().clone()
    err = (got - ref).abs().max().item()
    rel = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    return dict(kind="correctness", batch=b, context=step.seq_lens[0].item(), max_abs_diff=err, max_rel_l2=rel,
                finite=bool(torch.isfinite(got).all()))


def print_table(rows, batches, contexts) -> None:
    steps = {(r["impl"], r["batch"], r["context"]): r for r in rows if r["kind"] == "step"}
    print(f"\n{'B':>3} {'ctx':>6} {'graphs us':>10} {'mega us':>9} {'speedup':>8} {'floor us':>9} "
          f"{'graphs %floor':>13} {'mega %floor':>11}")
    for b in batches:
        for ctx in contexts:
            g, m = steps.get(("decode_graphs", b, ctx)), steps.get(("megakernel", b, ctx))
            if g is None:
                continue
            mus = f"{m['us_per_step']:>9.1f}" if m else f"{'-':>9}"
            sp = f"{g['us_per_step'] / m['us_per_step']:>7.2f}x" if m else f"{'-':>8}"
            mf = f"{100 * m['fraction_of_floor']:>10.1f}%" if m else f"{'-':>11}"
            print(f"{b:>3} {ctx:>6} {g['us_per_step']:>10.1f} {mus} {sp} {g['floor_us']:>9.1f} "
                  f"{100 * g['fraction_of_floor']:>12.1f}% {mf}")
    for r in rows:
        if r["kind"] == "correctness":
            print(f"correctness B={r['batch']:>2} ctx={r['context']}: max |mega - graphs| = {r['max_abs_diff']:.4f}, "
                  f"max relative L2 per row {r['max_rel_l2']:.2e}, finite={r['finite']}")
        elif r["kind"] == "head":
            print(f"{r['what']} B={r['batch']}: {r['us']:.1f} us (common to both paths, not in the step times)")


if __name__ == "__main__":
    raise SystemExit(main())
