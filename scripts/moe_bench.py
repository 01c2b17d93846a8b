#!/usr/bin/env python3
"""One MoE layer of the Qwen3-30B-A3B shape (hidden 2048, 128 experts, top-8, moe_intermediate 768, bf16, random
weights): minillm's fused kernels against the torch path (torch._grouped_mm), at 1, 8, 64 and 256 tokens (and at
prefill sizes with --tokens, where the question is the crossover: moe_ops.FUSED_MAX_TOKENS).

Per token count and path: the router GEMM (fp32, as the model runs it: the fused path is moe_ops.fused_moe, which
takes it into the routing launch at a few tokens), the routing and the experts, captured in one CUDA graph over
`--layers` layers with their own weights and inputs (about 1.2 GB of experts each, so a replay reads from HBM,
not L2), launched with PDL as the engine launches them. Reported per layer: the median over
replays (CUDA events) of the whole layer and of the routing alone, the experts the step touched (from the
routing), their weight bytes (+ the router's), and the effective rate bytes / layer time. A correctness column:
the fused layer's largest error relative to the torch path's largest value; and the experts' tensor rate,
2 * tokens * top_k * 3 * hidden * intermediate FLOPs over the layer time.

One JSON line per (tokens, path) is appended to --out, stamped with the commit and the GPU fingerprint.
Usage: python scripts/moe_bench.py [--out results/moe_kernels.jsonl] [--tokens 1,8,64,256] [--layers 4]
       [--replays 30] [--chain] [--variants]   (about 30 s on an H200)
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm.bench.report import append_jsonl  # noqa: E402
from minillm.ops import moe_ops  # noqa: E402
from minillm.ops.build import load_extension  # noqa: E402
from minillm.ops.launch import pdl_launches, pdl_supported  # noqa: E402

H, E, K, I = 2048, 128, 8, 768
DTYPE = torch.bfloat16


def make_layers(n: int, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    return [dict(w13=(0.02 * torch.randn(E, 2 * I, H, generator=g, device=dev)).to(DTYPE),
                 w2=(0.02 * torch.randn(E, H, I, generator=g, device=dev)).to(DTYPE),
                 router=0.05 * torch.randn(E, H, generator=g, device=dev)) for _ in range(n)]


# --variants: each small-step variant pair forced (gemv: the one-launch routing; comb: down with the combine in)
VARIANT_PATHS = {"gemv+comb": moe_ops.MoeVariant(True, True), "gemv": moe_ops.MoeVariant(True, False),
                 "comb": moe_ops.MoeVariant(False, True)}


def paths(chain: bool, variants: bool, tokens: int) -> tuple[str, ...]:
    """The paths timed at this token count: the gemv variants only where the routing kernel takes the count."""
    forced = [p for p, v in VARIANT_PATHS.items() if variants and (not v.route_gemv
                                                                    or tokens <= moe_ops.ROUTE_GEMV_TOKENS)]
    return ("torch", "fused") + (("chain",) if chain or variants else ()) + tuple(forced)


def layer_fn(path: str, layer: dict, x: torch.Tensor, route_only: bool):
    def run():
        if path == "fused":   # as the model runs it: moe_ops picks the variants by the token count
            if route_only:
                return moe_ops.fused_route(x, layer["router"], K, True).counts
            return moe_ops.fused_moe(x, layer["router"], layer["w13"], layer["w2"], K, True)
        if path in VARIANT_PATHS:   # one variant forced, whatever moe_variant would pick
            v = VARIANT_PATHS[path]
            r = moe_ops.fused_route(x, layer["router"], K, True, v)
            return r.counts if route_only else moe_ops.fused_experts(x, layer["w13"], layer["w2"], r,
                                                                     down_combine=v.down_combine)
        if path == "chain":   # the fused kernels without the small-step variants (router GEMV apart, combine apart)
            r = moe_ops.route_fused(F.linear(x.float(), layer["router"]), K, True)
            return r.counts if route_only else moe_ops.fused_experts(x, layer["w13"], layer["w2"], r)
        r = moe_ops.route(F.linear(x.float(), layer["router"]), K, True, weight_dtype=x.dtype)
        return r.counts if route_only else moe_ops.grouped_experts(x, layer["w13"], layer["w2"], r,
                                                                     graph_safe=True, cuda=True)
    return run


def time_graph(fns, replays: int, pdl: bool) -> tuple[float, list]:
    """Median us per fn over graph replays (each replay runs every fn once), and the fns' outputs."""
    with pdl_launches(pdl):
        outs = [fn() for fn in fns]   # warm-up outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [fn() for fn in fns]
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return statistics.median(times), outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/moe_kernels.jsonl")
    ap.add_argument("--tokens", default="1,8,64,256")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--chain", action="store_true",
                    help="also time the fused kernels as a launch chain (impl 'chain': no route_gemv, no "
                         "down_combine), to set moe_ops' ROUTE_GEMV_MAX_TOKENS and DOWN_COMBINE_MAX_TOKENS")
    ap.add_argument("--variants", action="store_true",
                    help="also time each variant pair forced (impls 'gemv+comb', 'gemv', 'comb', and 'chain')")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("moe_bench: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    load_extension()
    dev = torch.device("cuda")
    why = moe_ops.grouped_mm_unsupported_reason(dev, DTYPE, H, I) or \
        moe_ops.FUSED_COVERAGE.reason(dtype="bfloat16", capability=torch.cuda.get_device_capability())
    if why:
        print(f"moe_bench: error: {why}", file=sys.stderr)
        return 2
    pdl = pdl_supported(dev)
    layers = make_layers(args.layers, dev)
    expert_bytes = 3 * H * I * torch.tensor([], dtype=DTYPE).element_size()
    print(f"{'tokens':>6} {'path':>9} {'layer us':>9} {'route us':>9} {'experts':>7} {'MB':>7} {'TB/s':>6} "
          f"{'TFLOP/s':>7} {'rel err':>8}")
    for t in [int(v) for v in args.tokens.split(",")]:
        xs = [torch.randn(t, H, device=dev).to(DTYPE) for _ in layers]
        touched = [int((moe_ops.route(F.linear(x.float(), L["router"]), K, True).counts > 0).sum())
                   for x, L in zip(xs, layers)]
        nbytes = statistics.mean(touched) * expert_bytes + E * H * 4
        results = {}
        for path in paths(args.chain, args.variants, t):
            us, outs = time_graph([layer_fn(path, L, x, False) for L, x in zip(layers, xs)], args.replays, pdl)
            route_us, _ = time_graph([layer_fn(path, L, x, True) for L, x in zip(layers, xs)], args.replays, pdl)
            results[path] = (us, route_us, outs)
        ref = torch.stack([o.float() for o in results["torch"][2]])
        errs = {path: float((torch.stack([o.float() for o in outs]) - ref).abs().max() / ref.abs().max())
                for path, (_, _, outs) in results.items()}
        for path, (us, route_us, _) in results.items():
            line = dict(kind="moe_layer", impl=path, tokens=t, hidden=H, experts=E, top_k=K, intermediate=I,
                        dtype="bfloat16", layers=args.layers, pdl=pdl, layer_us=us, route_us=route_us,
                        touched_experts=statistics.mean(touched), touched_bytes=nbytes,
                        tb_s=nbytes / us / 1e6, tflops=2 * t * K * 3 * H * I / us / 1e6,
                        rel_err_vs_torch=errs[path] if path != "torch" else 0.0,
                        speedup_vs_torch=results["torch"][0] / us)
            append_jsonl(args.out, line)
            print(f"{t:>6} {path:>9} {us:>9.1f} {route_us:>9.1f} {line['touched_experts']:>7.1f} "
                  f"{nbytes / 1e6:>7.1f} {line['tb_s']:>6.2f} {line['tflops']:>7.1f} {line['rel_err_vs_torch']:>8.1e}")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
