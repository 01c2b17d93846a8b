#!/usr/bin/env bash
# One GPU call: install, build the extension, run every GPU test, then the default offline bench.
set -uo pipefail
: "${OUT:?}"
export PYTHONUNBUFFERED=1 MINILLM_EXT_DIR=${MINILLM_EXT_DIR:-$PWD/.ext} COLUMNS=200
python3 -m pip install --no-deps --no-build-isolation -q -e . > "$OUT/install.log" 2>&1
t=$(date +%s)
python3 -c "from minillm.ops.build import load_extension as ok; print('cuda ops:', bool(ok()))" 2>&1 | tail -5
echo "build: $(( $(date +%s) - t )) s"
python3 -m pytest -q -m gpu ${SMOKE_TESTS:-tests} -s 2>&1 | tee "$OUT/pytest_gpu.log" | grep -E "passed|failed|error|Error|max \|" | tail -20
[ -n "${SMOKE_BENCH-1}" ] && python3 -m minillm bench --no-progress --output "$OUT/bench.jsonl" ${BENCH_ARGS:-} 2>&1 | tail -25
tar -C "$MINILLM_EXT_DIR" -czf "$OUT/ext.tgz" --exclude='*.o' --exclude='*.ninja*' . 2>/dev/null
exit 0
