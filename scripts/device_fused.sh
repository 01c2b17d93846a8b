#!/usr/bin/env bash
# On a CUDA machine: build the fused kernels (cuda/fused*.cu, cuda/sampling*.cu, cuda/fused_bindings.cpp) into
# their own library, run tests/test_fused_gpu.py against it, then time each kernel against the torch path of
# minillm/ops/fused_ops.py at decode (T=256) and prefill (T=4096) shapes of Qwen3-0.6B.
# Usage: scripts/device_fused.sh [out_dir] [steps]   steps: any of "build test bench" (default: all three).
# Logs, pytest output and fused_bench.jsonl land in out_dir. FUSED_BUILD_DIR picks the build folder and
# FUSED_CXX_STD (e.g. c++17) overrides the C++ standard, which is otherwise torch's own default.
set -euo pipefail
OUT_DIR=${1:-${OUT:-/tmp/fused_out}}
STEPS=${2:-build test bench}
BUILD_DIR=${FUSED_BUILD_DIR:-/tmp/minillm_fused_build}
mkdir -p "$OUT_DIR" "$BUILD_DIR"
export PYTHONUNBUFFERED=1
export MINILLM_FUSED_EXT_LIB="$BUILD_DIR/minillm_fused.so"
step() { [[ " $STEPS " == *" $1 "* ]]; }

if step build; then
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -3 || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT_DIR/gpu.txt"
# Build only the fused sources (sm_90a), so this script does not depend on the state of other kernels.
python3 - "$BUILD_DIR" "${FUSED_CXX_STD:-}" <<'EOF' 2>&1 | tee -a "$OUT_DIR/build.log"
import sys, time
from pathlib import Path
from torch.utils.cpp_extension import load
build, std = Path(sys.argv[1]), [f"-std={sys.argv[2]}"] if sys.argv[2] else []
srcs = (sorted(Path("cuda").glob("fused_*.cu")) + sorted(Path("cuda").glob("sampling*.cu"))
        + [Path("cuda/fused_bindings.cpp")])
t0 = time.time()
load(name="minillm_fused", sources=[str(s) for s in srcs], build_directory=str(build), is_python_module=False,
     extra_cflags=["-O3"] + std, extra_include_paths=["cuda"],
     extra_cuda_cflags=["-O3", "-gencode", "arch=compute_90a,code=sm_90a"] + std)
print(f"built {len(srcs)} sources in {time.time() - t0:.1f} s into {build} (std: {std or 'torch default'})")
EOF
# 16-byte accesses show as LDG.E.128 / STG.E.128 in the machine code.
cuobjdump --dump-sass "$MINILLM_FUSED_EXT_LIB" > "$BUILD_DIR/sass.txt" || true
echo "LDG.E.128: $(grep -c 'LDG.E.128' "$BUILD_DIR/sass.txt" || true)  STG.E.128: $(grep -c 'STG.E.128' "$BUILD_DIR/sass.txt" || true)" \
  | tee "$OUT_DIR/sass_summary.txt"
fi

if step test; then
# A failing test must not stop the timings below: both are what the run is for.
python3 -m pytest -m gpu tests/test_fused_gpu.py -q --tb=short --maxfail=20 -p no:cacheprovider 2>&1 \
  | tee "$OUT_DIR/pytest.log" | tail -5 || echo "pytest: FAILURES (see pytest.log)"
fi

if step bench; then

python3 - "$OUT_DIR" <<'EOF' 2>&1 | tee "$OUT_DIR/bench.log"
# Median time per call from CUDA-graph replays (so launch gaps of the multi-kernel torch path do not count),
# inputs rotated over enough copies to exceed the 60 MB L2; GB/s counts each input read and output written once.
import json, math, statistics, sys
import torch
from minillm.fingerprint import stamp
from minillm.ops import fused_ops

torch.ops.load_library(__import__("os").environ["MINILLM_FUSED_EXT_LIB"])
out_dir, ops, dt = sys.argv[1], torch.ops.minillm, torch.bfloat16
H, I, HQ, HKV, D, V = 1024, 3072, 16, 8, 128, 151936
cache = fused_ops.rope_cos_sin_cache(D, 40960, 1e6, device="cuda")
qn, kn = torch.rand(D, device="cuda", dtype=dt) + 0.5, torch.rand(D, device="cuda", dtype=dt) + 0.5
w = torch.rand(H, device="cuda", dtype=dt) + 0.5


def torch_race(logits, inv_t):  # the multi-pass torch sampler: scale, softmax, noise, divide, argmax
    probs = torch.softmax(logits * inv_t[:, None], dim=-1)
    return probs.div_(torch.empty_like(probs).exponential_()).argmax(dim=-1)


def cases(t):
    n = 256 if t == 256 else 8
    return {
        "rms_norm": (lambda: (torch.randn(t, H, device="cuda", dtype=dt),), 2 * t * H * 2,
                     lambda x: ops.rms_norm(x, w, 1e-6), lambda x: fused_ops.rms_norm(x, w, 1e-6)),
        "fused_add_rms_norm": (lambda: tuple(torch.randn(t, H, device="cuda", dtype=dt) for _ in range(2)),
                               4 * t * H * 2,
                               lambda x, r: ops.fused_add_rms_norm(x, r, w, 1e-6),
                               lambda x, r: fused_ops.fused_add_rms_norm(x, r, w, 1e-6)),
        "silu_and_mul": (lambda: (torch.randn(t, 2 * I, device="cuda", dtype=dt),), 3 * t * I * 2,
                         ops.silu_and_mul, fused_ops.silu_and_mul),
        "qk_norm_rope": (lambda: (torch.randn(t, (HQ + 2 * HKV) * D, device="cuda", dtype=dt),
                                  torch.randint(0, 40960, (t,), device="cuda")), 2 * t * (HQ + 2 * HKV) * D * 2,
                         lambda x, p: ops.qk_norm_rope(x, p, cache, HQ, HKV, D, qn, kn, 1e-6),
                         lambda x, p: fused_ops.qk_norm_rope(x, p, cache, HQ, HKV, D, qn, kn, 1e-6)),
        f"sample_N{n}": (lambda: (torch.randn(n, V, device="cuda"), torch.full((n,), 1 / 0.6, device="cuda")),
                         n * V * 4, lambda l, it: ops.sample_exponential_race(l, it, 1, 0), torch_race),
    }


def time_graph(fn, sets, reps=20, trials=7):
    torch.cuda.synchronize()
    for s in sets[:3]:
        fn(*s)  # warm-up outside the graph
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(*sets[i % len(sets)])
    g.replay()
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


rows = []
for t in (256, 4096):
    for name, (make, nbytes, kernel, ref) in cases(t).items():
        sets = [make() for _ in range(max(1, min(20, math.ceil(192e6 / nbytes))))]
        us_k, us_t = time_graph(kernel, sets), time_graph(ref, sets)
        row = {"op": name, "T": t, "bytes": nbytes, "kernel_us": round(us_k, 2), "torch_us": round(us_t, 2),
               "kernel_GBps": round(nbytes / us_k / 1e3, 1), "torch_GBps": round(nbytes / us_t / 1e3, 1),
               "speedup": round(us_t / us_k, 2)}
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
meta = stamp()
with open(f"{out_dir}/fused_bench.jsonl", "w") as f:
    for r in rows:
        f.write(json.dumps(r | meta) + "\n")
print(f"{'op':<20}{'T':>6}{'kernel us':>11}{'torch us':>10}{'kernel GB/s':>13}{'torch GB/s':>12}{'speedup':>9}")
for r in rows:
    print(f"{r['op']:<20}{r['T']:>6}{r['kernel_us']:>11}{r['torch_us']:>10}{r['kernel_GBps']:>13}"
          f"{r['torch_GBps']:>12}{r['speedup']:>9}")
EOF
fi
