#!/usr/bin/env bash
# One GPU run for the prefill kernels: install, build the extension (cached under $MINILLM_EXT_DIR), the prefill
# GPU tests (the engine's kernels first, the opt-in wgmma kernel in a pytest run of its own so a fault there
# cannot hide the others), then scripts/prefill_bench.py. Logs and the benchmark lines go under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 MINILLM_EXT_DIR="${MINILLM_EXT_DIR:-$PWD/.ext}"
OUT="${OUT:-/tmp/prefill_out}"; mkdir -p "$OUT"
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
start=$(date +%s)
python3 -c "from minillm.ops.build import load_extension; load_extension()" 2>&1 | tail -30 || exit 1
echo "build: $(( $(date +%s) - start )) s"
python3 -m pytest -q -m gpu -k "not wgmma" tests/test_prefill_kernels.py tests/test_kernels_gpu.py \
  tests/test_plan.py 2>&1 | tee "$OUT/pytest.log" | tail -15
rc=${PIPESTATUS[0]}
python3 -m pytest -q -m gpu -k wgmma tests/test_prefill_kernels.py 2>&1 | tee "$OUT/pytest_wgmma.log" | tail -15
python3 scripts/prefill_bench.py --out "$OUT/prefill_kernels.jsonl" 2>&1 | tee "$OUT/bench.log" | tail -60
exit $rc
