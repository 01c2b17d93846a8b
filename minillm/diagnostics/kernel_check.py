"""The checks behind `minillm check-kernels`: every attention kernel against its fp32 reference, then timed
against torch. (The command itself is minillm/commands/check_kernels.py.)

Cases: KV write (whole cache compared bit-exact, untouched NaN slots unchanged), ragged prefill, prefix hits,
chunked prefill, tile/block-boundary lengths incl. 1, decode v1 / split-K / dispatched at small, long and mixed
batches, the backend's split and unified modes, over every head dim, GQA group, block size and dtype; the prefill
kernels the engine runs on the GPU (engine_kernels), also on long prompts (8k, 16k, 32k tokens and a 2,048-query
chunk over a 14k cached prefix). Caches start as NaN and block tables are random permutations. Timings use CUDA
events around CUDA-graph replays of many calls over rotating inputs larger than L2. One JSON line per case and per
timing goes to --output. The fp8 KV cache, the megakernel and the fused MoE kernels add their own cases
(kv_quant_check, megakernel_check, moe_check); the sampler's truncation threshold adds sampler_check's.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path


TOL = {"bfloat16": 2e-2, "float16": 4e-3}
# The prefill kernels the engine may run (attention_ops.prefill_kernel), those of them the GPU runs: engine_kernels().
ENGINE_PREFILL_KERNELS = ("wgmma", "wide", "narrow")
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
        yield "offset", [1000, 333, 129], [401, 200, 129], 0, None   # prefixes off the 64-key tile grid
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


def prefill_ref_chunked(b, scale: float, rows: int = 1024):
    """paged_attention_ref of a PagedBatch whose caches already hold this step's k/v, `rows` query rows at a time
    over only the keys those rows may see: the scores of a 32k-token prompt in one piece would take 64 GB."""
    import torch

    from minillm.ops.reference import attend, gather_kv

    out = torch.zeros(b.q.shape, dtype=torch.float32, device=b.q.device)
    starts = b.query_start_list
    for s, ctx in enumerate(b.seq_lens_list):
        lo, hi = starts[s], starts[s + 1]
        if hi <= lo:
            continue
        keys = gather_kv(b.k_cache, b.block_tables[s], ctx)
        values = gather_kv(b.v_cache, b.block_tables[s], ctx)
        for a in range(lo, hi, rows):
            e = min(hi, a + rows)
            q_pos = torch.arange(ctx - (hi - a), ctx - (hi - e), device=b.q.device)
            n = ctx - (hi - e)   # keys visible to the chunk's last row
            mask = torch.arange(n, device=b.q.device)[None, :] <= q_pos[:, None]
            out[a:e] = attend(b.q[None, a:e], keys[None, :n], values[None, :n], mask[None], scale)[0]
    return out


def _case_attention(kind, shape, batch, seed, kernel=None):
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
                          max(ql), kernel=kernel)
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
                if kind == "prefill":   # the engine's choice above; the other kernel too
                    err, tol = _case_attention(kind, shape, batch, seed, kernel="narrow")
                    rows.append(dict(case=f"prefill[narrow] {batch[0]} {tag}", max_abs_err=err, tol=tol,
                                     passed=err <= tol))
    from minillm.diagnostics.kv_quant_check import run_fp8_cases
    from minillm.diagnostics.megakernel_check import run_megakernel_cases
    from minillm.diagnostics.moe_check import run_moe_cases
    from minillm.diagnostics.sampler_check import run_threshold_cases

    return (rows + run_long_prefill_cases(quick) + run_fp8_cases(quick) + run_megakernel_cases(quick)
            + run_moe_cases(quick) + run_threshold_cases())


def long_prefill_batches(quick: bool):
    """(label, ctx_lens, q_lens) of the long-prompt cases: whole prompts, and a chunk over a cached prefix."""
    yield "T=8192", [8192], [8192]
    yield "chunk 2048 over 6144", [8192], [2048]
    if not quick:
        yield "T=16384", [16384], [16384]
        yield "chunk 2048 over 14336", [16384], [2048]
        yield "T=32768", [32768], [32768]


def run_long_prefill_cases(quick: bool, hq=16, hkv=8, d=128, bs=16, dt="bfloat16") -> list[dict]:
    """Both prefill kernels on long prompts (NaN-poisoned cache, random block table) against the chunked
    reference."""
    import torch

    from minillm.ops import attention_ops as ops
    from minillm.ops.reference import kv_write_ref, make_paged_batch

    rows, scale = [], d ** -0.5
    for seed, (label, ctx, ql) in enumerate(long_prefill_batches(quick), start=1000):
        b = make_paged_batch(ctx, ql, hq, hkv, d, bs, getattr(torch, dt), "cuda", seed)
        kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)
        ref = prefill_ref_chunked(b, scale)
        for kernel in engine_kernels():
            out = torch.full_like(b.q, float("nan"))
            ops.paged_prefill(out, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc,
                              scale, max(ql), kernel=kernel)
            err = _max_err(out, ref)
            rows.append(dict(case=f"prefill[{kernel}] long {label} D{d} H{hq}/{hkv} B{bs} {dt}", max_abs_err=err,
                             tol=TOL[dt], passed=err <= TOL[dt]))
        del b, ref
        torch.cuda.empty_cache()
    return rows


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


def prefill_flops(ctx: int, q_len: int, hq: int, d: int) -> float:
    """QK^T and PV FLOPs of q_len causal queries at the last positions of a ctx-token context: query i sees
    ctx - q_len + i + 1 keys (q_len = ctx: 4 H D T (T + 1) / 2)."""
    keys = q_len * (ctx - q_len) + q_len * (q_len + 1) / 2
    return 4 * hq * d * keys


def engine_kernels() -> tuple[str, ...]:
    """ENGINE_PREFILL_KERNELS this GPU runs."""
    import torch

    from minillm.ops import attention_ops as ops

    on = ops.prefill_kernels_on(torch.cuda.get_device_capability())
    return tuple(k for k in ENGINE_PREFILL_KERNELS if k in on)


def prefill_timings(ctx: int, q_len: int | None = None, hq=16, hkv=8, d=128, bs=16,
                    kernels=None, sdpa_too: bool = True) -> list[dict]:
    """Prefill kernels (default: engine_kernels()) and SDPA on contiguous K/V on one sequence: q_len queries
    (default ctx, a whole prompt) at the end of a ctx-token context, bf16. A chunk over a cached prefix is compared
    with SDPA's lower-right causal mask over K/V expanded to the query heads (SDPA's GQA path takes no such mask).
    With sdpa_too, also the cuDNN route as the engine runs it (cuda_backend._prefill: q a view of a step's qkv rows,
    K/V read back from the paged cache, attention_ops.prefill_cudnn). Every row also gives the first call's time
    (first_call_ms: for the cuDNN route, its plan build for a shape not seen before)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from minillm.ops import attention_ops as ops

    q_len = q_len or ctx
    kernels = engine_kernels() if kernels is None else kernels
    dev, dt, scale = "cuda", torch.bfloat16, d ** -0.5
    nb = -(-ctx // bs)
    q = torch.randn(q_len, hq, d, device=dev, dtype=dt)
    kc = torch.randn(nb, bs, hkv, d, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    bt = torch.randperm(nb, device=dev).to(torch.int32).view(1, -1)
    lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    k4 = kc[bt[0]].reshape(1, nb * bs, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    v4 = vc[bt[0]].reshape(1, nb * bs, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()
    if q_len == ctx:
        def sdpa():
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
    else:
        k4, v4 = k4.repeat_interleave(hq // hkv, 1), v4.repeat_interleave(hq // hkv, 1)
        mask = causal_lower_right(q_len, ctx)

        def sdpa():
            return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask)

    def ours(kernel):
        return lambda: ops.paged_prefill(out, q, kc, vc, bt, lens, qsl, scale, q_len, kernel=kernel)

    ref = sdpa()[0].transpose(0, 1).float()
    ms, errs, first = {}, {}, {}
    try:
        ms["sdpa causal"] = _time_graph([sdpa])
    except RuntimeError:   # its masked path may refuse graph capture in some torch builds: time the kernels alone
        torch.cuda.synchronize()
    base = ms.get("sdpa causal")
    if not sdpa_too:
        ms.clear()
    else:
        impls = _cudnn_route_impls(out, q, kc, vc, bt, ctx, scale) if ops.cudnn_attention_available() else {}
        for name, fn in impls.items():
            first[name] = _first_call_ms(fn)
            err = _max_err(out, ref)
            t, how = _time_graph_or_eager(fn)
            name += "" if how == "graph" else " (eager)"
            ms[name], errs[name] = t, err
    for kernel in kernels:
        first[f"minillm prefill {kernel}"] = _first_call_ms(ours(kernel))
        errs[f"minillm prefill {kernel}"] = _max_err(out, ref)
        ms[f"minillm prefill {kernel}"] = _time_graph([ours(kernel)])
    flops = prefill_flops(ctx, q_len, hq, d)
    what = f"T={ctx} causal" if q_len == ctx else f"{q_len} queries over a {ctx - q_len}-token prefix"
    bench = f"prefill {what} H{hq}/{hkv} D{d} bs{bs}"
    return [dict(bench=bench, impl=name, ms=t, tflops=flops / t / 1e9, ratio_vs_sdpa=base / t if base else None,
                 max_abs_err_vs_sdpa=errs.get(name), first_call_ms=first.get(name)) for name, t in ms.items()]


def _cudnn_route_impls(out, q, kc, vc, bt, ctx: int, scale: float) -> dict:
    """The cuDNN route as the engine calls it (cuda_backend._prefill): q a view of a step's qkv rows (the q, k and v
    heads of a token side by side, so its token stride is not Hq * D) and the context's k/v read back from the paged
    cache, where the fused KV write stored them."""
    import torch

    from minillm.ops import attention_ops as ops
    from minillm.ops.reference import gather_kv_batch

    t, hq, d = q.shape
    qkv = torch.empty(t, (hq + 2 * kc.shape[2]) * d, device=q.device, dtype=q.dtype)
    qkv[:, :hq * d] = q.reshape(t, hq * d)
    q_rows = qkv[:, :hq * d].view(t, hq, d)

    def route():
        k, v = (gather_kv_batch(c, bt, ctx)[0] for c in (kc, vc))
        out.copy_(ops.prefill_cudnn(q_rows, k, v, scale))

    return {"cudnn engine route (qkv views, K/V read back)": route}


def _first_call_ms(fn) -> float:
    """Wall milliseconds of one call of fn until the GPU is done (the first call of a shape: plans, module loads)."""
    import time

    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _time_graph_or_eager(fn) -> tuple[float, str]:
    """(_time_graph, "graph"), or where capture is refused, (the median ms of eager calls between CUDA events,
    "eager")."""
    import torch

    try:
        return _time_graph([fn]), "graph"
    except RuntimeError:
        torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), "eager"


def run_timings(quick: bool) -> list[dict]:
    rows = []
    decode_shapes = [(256, 1024), (8, 4096)] + ([] if quick else [(64, 512), (32, 2048), (1, 8192)])
    for batch, ctx in decode_shapes:
        rows += _decode_timings(batch, ctx)
    from minillm.diagnostics.kv_quant_check import run_fp8_timings

    rows += prefill_timings(4096)
    if not quick:
        rows += prefill_timings(16384) + prefill_timings(16384, 2048)
    return rows + run_fp8_timings()


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
