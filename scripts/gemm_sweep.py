"""Small-M GEMM sweep: our kernel (torch.ops.minillm.small_m_linear) vs F.linear (cuBLAS) at decode shapes.

    python3 scripts/gemm_sweep.py --output OUT.jsonl [--quick] [--tune] [--no-chain]

Single mode: for each Qwen3-0.6B GEMM (N, K) and M in 1..256, a CUDA graph of CALLS back-to-back calls over
rotating weight copies whose total is several times the L2 (so weights come from HBM, as in a real forward
where 28 layers' weights do not fit in L2); reports us per call, the effective weight bandwidth
(N * K * 2 bytes / time) and the launch shape our heuristic picked. Each point also checks our output against
cuBLAS's (max error relative to the output scale), so a first GPU run doubles as a smoke test.

Chain mode: 28 "layers" of [qkv, o_proj, gate_up, down] in one graph, each GEMM consuming a slice of the
previous output (so every launch depends on the one before), ours vs cuBLAS, and ours again in a child process
with MINILLM_PDL=0: what programmatic dependent launch buys end to end.

--tune also times every (tile_m, split_k) for each point and reports the best, to retune the heuristic in
cuda/small_m_gemm.cu (choose_split). One JSON line per point goes to --output; a table is printed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm.ops import gemm_ops  # noqa: E402

SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "lm_head": (151936, 1024)}
M_VALUES = [1, 8, 32, 64, 96, 130, 192, 256]
CHAIN_M = [1, 32, 130, 256]
CALLS = 20        # GEMMs per graph replay in single mode
LAYERS = 28
DTYPE = torch.bfloat16


def stamp() -> dict:
    try:
        from minillm.fingerprint import stamp as repo_stamp
        return repo_stamp()
    except Exception:  # the sweep must not die on a fingerprint helper
        return {}


def time_graph(fn, reps: int = 15, per_replay: int = 1) -> float:
    """Median microseconds per unit of work: fn() records `per_replay` units into one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()                       # warm-up outside the capture (lazy init, cuBLAS handles, workspaces)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / per_replay)
    del graph
    return statistics.median(times)


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    """Distinct weight copies so that consecutive calls never find their weights in L2."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    wbytes = n * k * 2
    count = max(2, min(CALLS, math.ceil(3 * l2 / wbytes)))
    g = torch.Generator("cuda").manual_seed(n + k)
    return [(torch.randn(n, k, generator=g, device="cuda") / math.sqrt(k)).to(DTYPE) for _ in range(count)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


def single_point(name: str, n: int, k: int, m: int, ws: list[torch.Tensor], sms: int, tune: bool) -> list[dict]:
    x = torch.randn(m, k, device="cuda").to(DTYPE)
    plan = gemm_ops.plan(m, n, k, sms)
    err = rel_err(gemm_ops.small_m_linear(x, ws[0]), F.linear(x, ws[0]))

    def ours(tile_m=0, split_k=0):
        def run():
            for i in range(CALLS):
                gemm_ops.small_m_linear(x, ws[i % len(ws)], None, tile_m, split_k)
        return run

    def cublas():
        for i in range(CALLS):
            F.linear(x, ws[i % len(ws)])

    gb = n * k * 2 / 1e9
    t_ours, t_cublas = time_graph(ours(), per_replay=CALLS), time_graph(cublas, per_replay=CALLS)
    base = dict(mode="single", name=name, n=n, k=k, m=m, dtype=str(DTYPE).replace("torch.", ""))
    rows = [dict(base, impl="cublas", us=round(t_cublas, 2), weight_gbps=round(gb / (t_cublas * 1e-6), 1)),
            dict(base, impl="small_m", us=round(t_ours, 2), weight_gbps=round(gb / (t_ours * 1e-6), 1),
                 tile_m=plan["tile_m"], split_k=plan["split_k"], ctas=plan["grid_x"] * plan["grid_y"] * plan["grid_z"],
                 speedup=round(t_cublas / t_ours, 2), max_rel_err=float(f"{err:.2e}"))]
    if tune:
        best = None
        for tile_m in (64, 128, 256):   # tile_m < M: several token tiles, each re-reading the weights from L2
            for split in (1, 2, 3, 4, 6, 8, 12, 16):
                if split > k // 64:
                    continue
                t = time_graph(ours(tile_m, split), reps=7, per_replay=CALLS)
                if best is None or t < best[0]:
                    best = (t, tile_m, split)
        rows.append(dict(base, impl="small_m_best", us=round(best[0], 2), weight_gbps=round(gb / (best[0] * 1e-6), 1),
                         tile_m=best[1], split_k=best[2], speedup=round(t_cublas / best[0], 2)))
    return rows


def chain_layers() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator("cuda").manual_seed(0)

    def w(name):
        n, k = SHAPES[name]
        return (torch.randn(n, k, generator=g, device="cuda") / math.sqrt(k)).to(DTYPE)
    return [(w("qkv"), w("o_proj"), w("gate_up"), w("down")) for _ in range(LAYERS)]


def chain_step(gemm, layers, x: torch.Tensor) -> torch.Tensor:
    """28 layers x 4 dependent GEMMs: qkv(x) -> o_proj(qkv[:, :2048]) -> gate_up -> down(gate_up[:, :3072])."""
    h = x
    for wq, wo, wgu, wd in layers:
        q = gemm(h, wq)
        o = gemm(q[:, :2048], wo)
        gu = gemm(o, wgu)
        h = gemm(gu[:, :3072], wd)
    return h


def chain_points(impl: str, layers, ms: list[int]) -> list[dict]:
    gemm = gemm_ops.small_m_linear if impl.startswith("small_m") else F.linear
    layer_bytes = sum(t.numel() * 2 for t in layers[0])
    rows = []
    for m in ms:
        x = torch.randn(m, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).to(DTYPE)
        # Ours and cuBLAS round differently at each of the 112 GEMMs: the relative difference of the final
        # activations random-walks to ~1e-2; a layout bug would show as O(1).
        err = rel_err(chain_step(gemm, layers, x), chain_step(F.linear, layers, x))
        t = time_graph(lambda: chain_step(gemm, layers, x), reps=10)
        rows.append(dict(mode="chain", impl=impl, m=m, layers=LAYERS, us_step=round(t, 1),
                         us_per_gemm=round(t / (4 * LAYERS), 2),
                         weight_gbps=round(LAYERS * layer_bytes / 1e9 / (t * 1e-6), 1),
                         rel_err_vs_cublas=float(f"{err:.2e}")))
    return rows


def print_single(rows: list[dict]) -> None:
    print(f"\n{'gemm':8} {'N':>6} {'K':>5} {'M':>4} | {'cuBLAS us':>9} {'GB/s':>6} | {'ours us':>8} {'GB/s':>6} "
          f"{'tile':>4} {'split':>5} {'ctas':>5} {'x':>5} {'rel err':>8}" + (" | best us tile split" if any(
              r["impl"] == "small_m_best" for r in rows) else ""))
    by = {}
    for r in rows:
        by.setdefault((r["name"], r["m"]), {})[r["impl"]] = r
    for (name, m), d in by.items():
        c, o, b = d["cublas"], d["small_m"], d.get("small_m_best")
        line = (f"{name:8} {o['n']:6} {o['k']:5} {m:4} | {c['us']:9.2f} {c['weight_gbps']:6.0f} | {o['us']:8.2f} "
                f"{o['weight_gbps']:6.0f} {o['tile_m']:4} {o['split_k']:5} {o['ctas']:5} {o['speedup']:5.2f} "
                f"{o['max_rel_err']:8.1e}")
        if b:
            line += f" | {b['us']:7.2f} {b['tile_m']:4} {b['split_k']:5}"
        print(line)


def print_chain(rows: list[dict]) -> None:
    print(f"\nchain: {LAYERS} layers x [qkv, o_proj, gate_up, down], each GEMM reading the previous output")
    print(f"{'impl':18} {'M':>4} {'us/step':>9} {'us/gemm':>8} {'GB/s':>6} {'vs cuBLAS':>9} {'rel err':>8}")
    cublas = {r["m"]: r["us_step"] for r in rows if r["impl"] == "cublas"}
    for r in rows:
        x = cublas.get(r["m"], float("nan")) / r["us_step"]
        print(f"{r['impl']:18} {r['m']:4} {r['us_step']:9.1f} {r['us_per_gemm']:8.2f} {r['weight_gbps']:6.0f} "
              f"{x:9.2f} {r['rel_err_vs_cublas']:8.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", default=None, help="JSON lines file (appended)")
    ap.add_argument("--quick", action="store_true", help="M in {1, 130, 256} only")
    ap.add_argument("--tune", action="store_true", help="also time every (tile_m, split_k) per point (~2 more min)")
    ap.add_argument("--no-chain", action="store_true", help="skip the chained 28-layer mode")
    ap.add_argument("--chain-only", action="store_true", help=argparse.SUPPRESS)  # the MINILLM_PDL=0 child
    ap.add_argument("--impl-label", default="small_m", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gemm_sweep: needs a CUDA GPU")
    gemm_ops.counters("cuda")  # builds / loads the extension and allocates the counters outside any capture
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    ms = [1, 130, 256] if args.quick else M_VALUES
    rows: list[dict] = []
    if args.chain_only:
        rows = chain_points(args.impl_label, chain_layers(), [1, 130] if args.quick else CHAIN_M)
        for r in rows:
            print(json.dumps(r))
        return
    print(f"{props.name}: {sms} SMs, L2 {getattr(props, 'L2_cache_size', 0) >> 20} MB, MINILLM_PDL="
          f"{os.environ.get('MINILLM_PDL', '1')}, {CALLS} calls per graph over rotating weight copies")
    for name, (n, k) in SHAPES.items():
        ws = weight_copies(n, k)
        for m in ms:
            rows += single_point(name, n, k, m, ws, sms, args.tune)
        del ws
        torch.cuda.empty_cache()
    print_single(rows)
    if not args.no_chain:
        layers = chain_layers()
        chain = chain_points("cublas", layers, [1, 130] if args.quick else CHAIN_M)
        chain += chain_points("small_m", layers, [1, 130] if args.quick else CHAIN_M)
        del layers
        torch.cuda.empty_cache()
        cmd = [sys.executable, __file__, "--chain-only", "--impl-label", "small_m_pdl_off"]
        cmd += ["--quick"] if args.quick else []
        child = subprocess.run(cmd, env=dict(os.environ, MINILLM_PDL="0"), capture_output=True, text=True,
                               timeout=300)
        if child.returncode == 0:
            chain += [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
        else:
            print(f"(MINILLM_PDL=0 child failed: {child.stderr.strip()[-500:]})")
        print_chain(chain)
        rows += chain
    if args.output:
        extra = stamp()
        with open(args.output, "a") as f:
            for r in rows:
                f.write(json.dumps({**r, **extra}) + "\n")
        print(f"\n{len(rows)} lines -> {args.output}")


if __name__ == "__main__":
    main()
