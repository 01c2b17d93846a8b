#!/usr/bin/env bash
# One GPU run for the decode megakernel (sm_90): build the extension, run tests/test_megakernel_gpu.py, time the
# megakernel against the CUDA-graph decode path (scripts/megakernel_bench.py), and with --ncu profile one
# megakernel launch at B=1 and B=8 (context 512) with Nsight Compute. Every log and result lands in OUT_DIR; a
# summary table comes last. Budget: ~4 minutes without --ncu (the build is most of it when nothing is cached).
# Usage: scripts/megakernel_device.sh OUT_DIR [--ncu]
# Setup done beforehand: python3 -m pip install --no-deps --no-build-isolation -e .
set -uo pipefail
OUT=${1:?usage: scripts/megakernel_device.sh OUT_DIR [--ncu]}
NCU=${2:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MINILLM_EXT_DIR="${MINILLM_EXT_DIR:-$PWD/.ext}"
export MINILLM_COMMIT="${MINILLM_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}"
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader \
  > "$OUT/gpu.txt" 2>&1

echo "== build" | tee "$OUT/summary.txt"
timeout 300 python3 -c "from minillm.ops.build import load_extension; load_extension(); print('extension loaded')" \
  > "$OUT/build.log" 2>&1
build_rc=$?
t_build=$(( $(date +%s) - t0 ))
tail -3 "$OUT/build.log"

echo "== tests"
t1=$(date +%s)
if [[ $build_rc -eq 0 ]]; then
  timeout 240 python3 -m pytest -m gpu tests/test_megakernel_gpu.py -q -rA --tb=short -p no:cacheprovider -s \
    > "$OUT/pytest.log" 2>&1
  test_rc=$?
else
  test_rc=99
fi
t_test=$(( $(date +%s) - t1 ))
tail -3 "$OUT/pytest.log" 2>/dev/null

echo "== bench"
t2=$(date +%s)
if [[ $build_rc -eq 0 ]]; then
  timeout 240 python3 scripts/megakernel_bench.py --out "$OUT/megakernel_bench.jsonl" > "$OUT/bench.log" 2>&1
  bench_rc=$?
else
  bench_rc=99
fi
t_bench=$(( $(date +%s) - t2 ))

ncu_rc=-
if [[ "$NCU" == "--ncu" && $build_rc -eq 0 ]] && command -v ncu > /dev/null; then
  echo "== ncu"
  for b in 1 8; do
    timeout 300 ncu --clock-control none --set full -k regex:decode_megakernel --launch-skip 1 --launch-count 1 \
      -f -o "$OUT/megakernel_b$b" python3 scripts/megakernel_bench.py --out /dev/null --megakernel-only \
      --batches "$b" --contexts 512 > "$OUT/ncu_b$b.log" 2>&1
    ncu_rc=$?
    ncu --import "$OUT/megakernel_b$b.ncu-rep" --page details > "$OUT/ncu_b${b}_details.txt" 2>&1 || true
  done
fi

{
  echo
  echo "==================== megakernel device run summary ===================="
  echo "gpu: $(cat "$OUT/gpu.txt")   commit: $MINILLM_COMMIT"
  echo "build rc=$build_rc (${t_build}s)   tests rc=$test_rc (${t_test}s)   bench rc=$bench_rc (${t_bench}s)   ncu rc=$ncu_rc"
  echo "tests: $(grep -E '^(=+ )?[0-9]+ (passed|failed)|passed|failed|error' "$OUT/pytest.log" 2>/dev/null | tail -1)"
  grep -E '^FAILED|^ERROR' "$OUT/pytest.log" 2>/dev/null | head -10
  grep -E 'aborting|CUDA error|Error' "$OUT/pytest.log" "$OUT/bench.log" 2>/dev/null | head -5
  sed -n '/^  B /,$p' "$OUT/bench.log" 2>/dev/null
  echo "logs and results: $OUT (total $(( $(date +%s) - t0 ))s)"
} | tee -a "$OUT/summary.txt"
[[ $build_rc -eq 0 && $test_rc -eq 0 && $bench_rc -eq 0 ]]
