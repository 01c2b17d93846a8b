#!/usr/bin/env bash
# One GPU run for the attention kernels: install, build the extension (cached under $MINILLM_EXT_DIR, kept
# between runs by copying it to $OUT), run the GPU tests and check-kernels, leave results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 MINILLM_EXT_DIR="${MINILLM_EXT_DIR:-$PWD/.ext}"
OUT="${OUT:-/tmp/kernels_out}"; mkdir -p "$OUT"
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
start=$(date +%s)
python3 -c "from minillm.ops.build import load_extension; load_extension()" 2>&1 | tail -30 || exit 1
echo "build: $(( $(date +%s) - start )) s"
python3 -m pytest -q -x -m gpu tests/test_kernels_gpu.py 2>&1 | tee "$OUT/pytest.log" | tail -15
python3 -m minillm check-kernels --output "$OUT/kernels.jsonl" ${CHECK_ARGS:-} 2>&1 | tee "$OUT/check.log" | grep -v " ok " | tail -60
rc=${PIPESTATUS[0]}
# The built extension, for a later run to carry (cuda sources unchanged -> same hash -> no rebuild).
tar -C "$MINILLM_EXT_DIR" -czf "$OUT/ext.tgz" --exclude='*.o' --exclude='*.ninja*' . 2>/dev/null
exit $rc
