"""The checks behind `minillm check-kernels`: every attention kernel against its fp32 reference, then timed
against torch. (The command itself is minillm/commands/check_kernels.py.)

Cases: KV write (whole cache compared bit-exact, untouched NaN slots unchanged), ragged prefill, prefix hits,
chunked prefill, tile/block-boundary lengths incl. 1, decode v1 / split-K / dispatched at small, long and mixed
batches, the backend's split and unified modes, over every head dim, GQA group, block size and dtype. Caches
start as NaN and block tables are random permutations. Timings use CUDA events around CUDA-graph replays of
many calls over rotating inputs larger than L2. One JSON line per case and per timing goes to --output.
The fp8 KV cache, the megakernel and the fused MoE kernels add their own cases (kv_quant_check, megakernel_check,
moe_check).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path


TOL = {"bfloat16": 2e-2, "float16": 4e-3}
KINDS = ("kv_write", "prefill", "decode", "backend")


def _shapes(quick: bool):
    """(head_dim, num_q_heads, num_kv_heads, block_size, dtype name) combinations to check."""
    groups = [(16, 8), (8, 8), (16, 2)] if quick else [(16, 8), (8, 8), (12, 4), (16, 4), (16, 2), (6, 1), (32, 2)]
    for d in (64, 128):
        for hq, hkv in groups:
            for bs in (16, 32):
                for dt in ("bfloat16", "float16"):
                    yield d, hq, hkv, bs, dt


def _batches(kind: str, quick: bool):
    """(label, ctx_lens, q_lens, num_decodes, forced partition size) per kernel kind."""
    if kind == "prefill":
        yield "ragged", [1, 15, 16, 17, 63, 64, 65, 129], [1, 15, 16, 17, 63, 64, 65, 129], 0, None
        yield "prefix_hit", [80, 300, 33], [16, 45, 1], 0, None
        yield "chunked", [512, 700], [256, 188], 0, None
    elif kind == "decode":
        yield "small", [1, 16, 17, 33, 100], [1] * 5, 5, None
        yield "long_v1", [3000, 4100], [1, 1], 2, 0
        yield "long_split256", [3000, 4100, 5], [1, 1, 1], 3, 256
        yield "ragged_equal5", [3000, 1, 33, 4100, 300], [1] * 5, 5, -5
        if not quick:
            yield "long_split1024", [2047, 2048, 2049], [1, 1, 1], 3, 1024
            yield "many_auto", [int(x) for x in range(20, 20 + 37 * 40, 40)], [1] * 37, 37, None
    elif kind == "backend":
        yield "mixed", [40, 1000, 17, 300, 64], [1, 1, 17, 120, 64], 2, None


def _finite(row: dict) -> dict:
    """JSON has no NaN/inf: a non-finite error (NaN read, bit mismatch) is written as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def _max_err(out, ref):
    import torch

    diff = (out.float() - ref).abs()
    return float("nan") if torch.isnan(diff).any() else float(diff.max())


def _case_kv_write(shape, seed):
    import torch

    from minillm.ops import attention_ops as ops
    from minillm.ops.reference import kv_write_ref, make_paged_batch

    d, hq, hkv, bs, dt = shape
    b = make_paged_batch([37, 5, 64], [37, 3, 20], hq, hkv, d, bs, getattr(torch, dt), "cuda", seed)
    slots = b.slot_mapping.clone()
    slots[::7] = -1  # padded rows must be skipped
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    ops.kv_write(b.k, b.v, kc, vc, slots)
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, slots)
    # Compare bit patterns so NaN == NaN for untouched slots and any stray write shows.
    same = torch.equal(kc.view(torch.int16), b.k_cache.view(torch.int16)) and \
        torch.equal(vc.view(torch.int16), b.v_cache.view(torch.int16))
    return 0.0 if same else float("inf"), 0.0


def _case_attention(kind, shape, batch, seed):
    import torch

    from minillm.attention.cuda_backend import CudaAttentionBackend
    from minillm.diagnostics import paged_meta
    from minillm.ops import attention_ops as ops
    from minillm.ops.reference import kv_write_ref, make_paged_batch, paged_attention_ref

    d, hq, hkv, bs, dt = shape
    _, ctx, ql, nd, part = batch
    b = make_paged_batch(ctx, ql, hq, hkv, d, bs, getattr(torch, dt), "cuda", seed)
    scale = d ** -0.5
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens_list, b.query_start_list, scale)
    if kind == "backend":
        errs = []
        for mode in ("split", "unified"):
            k2, v2 = kc.clone(), vc.clone()
            out = CudaAttentionBackend(mode).forward(b.q, b.k, b.v, k2, v2, paged_meta(b, nd), scale)
            errs.append(_max_err(out, ref))
        return max(errs, key=lambda e: (e != e, e)), TOL[dt]
    out = torch.full_like(b.q, float("nan"))
    if kind == "prefill":
        ops.paged_prefill(out, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, scale,
                          max(ql))
    else:
        ops.paged_decode(out, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, scale, max(ctx), part)
    return _max_err(out, ref), TOL[dt]


def run_cases(quick: bool) -> list[dict]:
    rows, seed = [], 0
    for shape in _shapes(quick):
        d, hq, hkv, bs, dt = shape
        tag = f"D{d} H{hq}/{hkv} B{bs} {dt}"
        seed += 1
        err, tol = _case_kv_write(shape, seed)
        rows.append(dict(case=f"kv_write {tag}", max_abs_err=err, tol=tol, passed=err <= tol))
        for kind in KINDS[1:]:
            for batch in _batches(kind, quick):
                seed += 1
                err, tol = _case_attention(kind, shape, batch, seed)
                rows.append(dict(case=f"{kind} {batch[0]} {tag}", max_abs_err=err, tol=tol, passed=err <= tol))
    from minillm.diagnostics.kv_quant_check import run_fp8_cases
    from minillm.diagnostics.megakernel_check import run_megakernel_cases
    from minillm.diagnostics.moe_check import run_moe_cases

    return rows + run_fp8_cases(quick) + run_megakernel_cases(quick) + run_moe_cases(quick)


def _time_graph(fn_list, reps: int = 10) -> float:
    """Median ms per call: each replay runs every fn (one per rotating input set) several times."""
    import torch

    per_graph = 4
    for fn in fn_list:  # warm-up outside capture (workspace allocation, lazy init)
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            for fn in fn_list:
                fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (per_graph * len(fn_list)))
    return statistics.median(times)


def _rotations(set_bytes: int) -> int:
    """Input sets to cycle through so that the working set is several times the L2 (60 MB on an H200)."""
    import torch

    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
    return max(2, min(8, -(-4 * l2 // set_bytes)))


def _decode_timings(batch: int, ctx: int, hq=16, hkv=8, d=128, bs=16) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from minillm.ops import attention_ops as ops

    dev, dt, scale = "cuda", torch.bfloat16, d ** -0.5
    kv_bytes = batch * ctx * hkv * d * 2 * 2
    rot, nb = _rotations(kv_bytes), ctx // bs
    kc = torch.randn(rot * batch * nb, bs, hkv, d, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    bt = torch.randperm(rot * batch * nb, device=dev).to(torch.int32).view(rot, batch, nb)
    q = torch.randn(rot, batch, hq, d, device=dev, dtype=dt)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    out = torch.empty(batch, hq, d, device=dev, dtype=dt)
    kcont = [kc[bt[i]].view(batch, ctx, hkv, d).transpose(1, 2).contiguous() for i in range(rot)]
    vcont = [vc[bt[i]].view(batch, ctx, hkv, d).transpose(1, 2).contiguous() for i in range(rot)]

    def ours(part):
        return [lambda i=i: ops.paged_decode(out, q[i], kc, vc, bt[i], lens, scale, ctx, part) for i in range(rot)]

    def sdpa(i):
        return F.scaled_dot_product_attention(q[i].unsqueeze(2), kcont[i], vcont[i], enable_gqa=True)

    def gather_sdpa(i):
        k = kc[bt[i]].view(batch, ctx, hkv, d).transpose(1, 2)
        v = vc[bt[i]].view(batch, ctx, hkv, d).transpose(1, 2)
        return F.scaled_dot_product_attention(q[i].unsqueeze(2), k, v, enable_gqa=True)

    auto = ops.decode_partition_size(batch, hkv, ctx, torch.cuda.get_device_properties(0).multi_processor_count)
    impls = {f"minillm auto (partition {auto})": ours(None), "minillm v1": ours(0)}
    for part in (256, 512, 1024):
        if part < ctx:
            impls[f"minillm split{part}"] = ours(part)
    for parts in (2, 4, 8):
        impls[f"minillm equal{parts}"] = ours(-parts)
    impls["sdpa contiguous"] = [lambda i=i: sdpa(i) for i in range(rot)]
    impls["gather+sdpa"] = [lambda i=i: gather_sdpa(i) for i in range(rot)]
    ms = {name: _time_graph(fns) for name, fns in impls.items()}
    ops.paged_decode(out, q[0], kc, vc, bt[0], lens, scale, ctx)
    err = _max_err(out, sdpa(0).squeeze(2).float())
    bench = f"decode B={batch} ctx={ctx} H{hq}/{hkv} D{d} bs{bs}"
    return [dict(bench=bench, impl=name, ms=t, tb_s=kv_bytes / t / 1e9, ratio_vs_sdpa=ms["sdpa contiguous"] / t,
                 max_abs_err_vs_sdpa=err) for name, t in ms.items()]


def _prefill_timings(seq: int, hq=16, hkv=8, d=128, bs=16) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from minillm.ops import attention_ops as ops

    dev, dt, scale = "cuda", torch.bfloat16, d ** -0.5
    q = torch.randn(seq, hq, d, device=dev, dtype=dt)
    kc = torch.randn(seq // bs, bs, hkv, d, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    bt = torch.randperm(seq // bs, device=dev).to(torch.int32).view(1, -1)
    lens = torch.tensor([seq], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, seq], dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    k4 = kc[bt[0]].view(1, seq, hkv, d).transpose(1, 2).contiguous()
    v4 = vc[bt[0]].view(1, seq, hkv, d).transpose(1, 2).contiguous()
    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()
    ms = {"minillm prefill": _time_graph([lambda: ops.paged_prefill(out, q, kc, vc, bt, lens, qsl, scale, seq)]),
          "sdpa causal": _time_graph([lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True,
                                                                             enable_gqa=True)])}
    ref = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    ops.paged_prefill(out, q, kc, vc, bt, lens, qsl, scale, seq)
    err = _max_err(out, ref.float())
    flops = 4 * hq * d * seq * (seq + 1) / 2  # QK^T and PV over the causal half
    bench = f"prefill T={seq} causal H{hq}/{hkv} D{d} bs{bs}"
    return [dict(bench=bench, impl=name, ms=t, tflops=flops / t / 1e9, ratio_vs_sdpa=ms["sdpa causal"] / t,
                 max_abs_err_vs_sdpa=err) for name, t in ms.items()]


def run_timings(quick: bool) -> list[dict]:
    rows = []
    decode_shapes = [(256, 1024), (8, 4096)] + ([] if quick else [(64, 512), (32, 2048), (1, 8192)])
    for batch, ctx in decode_shapes:
        rows += _decode_timings(batch, ctx)
    from minillm.diagnostics.kv_quant_check import run_fp8_timings

    return rows + _prefill_timings(4096) + run_fp8_timings()


def _print_cases(rows) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="attention kernels vs fp32 reference")
    for col in ("case", "max abs err", "tol", "pass"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["case"], f"{r['max_abs_err']:.2e}", f"{r['tol']:.0e}",
                      "[green]ok[/]" if r["passed"] else "[red]FAIL[/]")
    Console().print(table)


def _print_timings(rows) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="timings (median, CUDA-graph replays, rotating inputs)")
    for col in ("benchmark", "impl", "ms", "rate", "vs SDPA"):
        table.add_column(col)
    for r in rows:
        rate = f"{r['tb_s']:.2f} TB/s" if "tb_s" in r else f"{r['tflops']:.0f} TFLOP/s"
        ratio = f"{r['ratio_vs_sdpa']:.2f}x" if r.get("ratio_vs_sdpa") else ""
        table.add_row(r["bench"], r["impl"], f"{r['ms']:.4f}", rate, ratio)
    Console().print(table)


def run_all(output: Path, quick: bool = False, timing: bool = True) -> tuple[int, int, int]:
    """Check every case, time the kernels (unless `timing` is off), print both tables and append every row to
    `output`. Needs a CUDA GPU. Returns (cases passed, cases, timings)."""
    from minillm.fingerprint import stamp
    from minillm.ops.build import load_extension

    load_extension()
    cases = run_cases(quick)
    _print_cases(cases)
    timings = run_timings(quick) if timing else []
    if timings:
        _print_timings(timings)
    output.parent.mkdir(parents=True, exist_ok=True)
    base = stamp()
    with output.open("a") as f:
        for kind, rows in (("case", cases), ("timing", timings)):
            for r in rows:
                f.write(json.dumps({"kind": kind, **_finite(r), **base}) + "\n")
    return sum(bool(r["passed"]) for r in cases), len(cases), len(timings)
