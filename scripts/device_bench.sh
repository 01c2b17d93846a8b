#!/usr/bin/env bash
# Full-scale `minillm bench` and `minillm latency-sweep` on H200s; every result lands under $OUT.
#
#   scripts/device_bench.sh bench            one GPU, ~6-7 min: the bench.yaml --compare list on the offline
#                                            reference (256 requests) + the HF transformers peer on the first
#                                            $HF_REQUESTS (default 32) requests, one JSONL
#   scripts/device_bench.sh latency NAMES    one GPU: the latency sweep (4 and 8 req/s) for the comma-separated
#                                            configs of configs/latency.yaml; ~100 s per config, so split the 7
#                                            over calls, e.g. "prefill-first,chunked-512,chunked-1024",
#                                            "chunked-2048,chunked-4096", "chunked-8192,chunked-2048-unified";
#                                            merge the JSONL files and redraw with --plot-only
#   scripts/device_bench.sh all              >= 4 GPUs, ~8 min: bench on GPU 0 and the latency configs spread
#                                            over GPUs 1-3 (one process per GPU), merged JSONL + figure
#
# Timing excludes install, kernel build, model load and warm-up (each is recorded separately in the JSONL).
set -euo pipefail
: "${OUT:?set OUT to the folder the results go to}"
HF_REQUESTS=${HF_REQUESTS:-32}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"

export PYTHONUNBUFFERED=1
# Keep the compiled CUDA extension in the (git-ignored) .ext/ of this tree, so a later call on a warm machine
# loads it instead of compiling again.
export MINILLM_EXT_DIR=${MINILLM_EXT_DIR:-$PWD/.ext}
# No network on the GPU machine: the dependencies are already there; only the package itself is installed.
python3 -m pip install --no-deps --no-build-isolation -q -e . > "$OUT/install.log" 2>&1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
git log -1 --format='%H %cI %s' > "$OUT/commit.txt" 2>/dev/null || true

export COLUMNS=200   # rich tables in the logs at full width
# Compile the CUDA extension once, before any (possibly parallel) run would race to build it.
python3 -c "import time; t=time.perf_counter(); from minillm.ops.build import load_extension as ok; \
print('cuda ops:', bool(ok()), f'build/load {time.perf_counter()-t:.1f} s')" > "$OUT/build.log" 2>&1

mb() { python3 -m minillm "$@" --no-progress; }

run_bench() {   # $1: GPU index
    CUDA_VISIBLE_DEVICES=$1 mb bench --compare --output "$OUT/bench.jsonl" > "$OUT/bench.log" 2>&1 || echo "bench: some runs failed (see bench.log)"
    CUDA_VISIBLE_DEVICES=$1 mb bench --engine hf --num-requests "$HF_REQUESTS" --output "$OUT/bench.jsonl" \
        > "$OUT/bench_hf.log" 2>&1 || echo "hf peer failed (see bench_hf.log)"
}

run_latency() {  # $1: GPU index, $2: comma-separated config names, $3: tag for the file names
    CUDA_VISIBLE_DEVICES=$1 mb latency-sweep --configs "$2" --output "$OUT/latency_$3.jsonl" \
        --plot "$OUT/latency_$3.png" > "$OUT/latency_$3.log" 2>&1 || echo "latency $2: failed (see latency_$3.log)"
}

merge_and_plot() {
    cat "$OUT"/latency_*.jsonl > "$OUT/latency.jsonl"
    mb latency-sweep --plot-only "$OUT/latency.jsonl" --plot "$OUT/latency.png" > "$OUT/latency_table.txt" 2>&1
}

case "${1:-bench}" in
    bench)
        run_bench 0 ;;
    latency)
        names=${2:?name the latency configs, e.g. prefill-first,chunked-512}
        run_latency 0 "$names" "${names//,/_}" ;;
    all)
        gpus=$(nvidia-smi -L | wc -l)
        if [ "$gpus" -lt 4 ]; then echo "'all' needs 4 GPUs, found $gpus" >&2; exit 2; fi
        run_bench 0 &
        run_latency 1 prefill-first,chunked-512,chunked-1024 a &
        run_latency 2 chunked-2048,chunked-4096 b &
        run_latency 3 chunked-8192,chunked-2048-unified c &
        wait
        merge_and_plot ;;
    *)
        echo "usage: $0 bench | latency NAMES | all" >&2; exit 2 ;;
esac
cat "$OUT"/*.log | grep -v "^\s*$" | tail -n 80 || true
