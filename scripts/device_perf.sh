#!/usr/bin/env bash
# The next performance experiment in one GPU call (~6 min): where a decode step's time goes at three batch /
# context shapes, with and without async scheduling; then the offline bench and the 8 req/s chunked-2048
# latency point, each with and without async scheduling. Everything lands under $OUT.
set -uo pipefail
: "${OUT:?}"
export PYTHONUNBUFFERED=1 MINILLM_EXT_DIR=${MINILLM_EXT_DIR:-$PWD/.ext} COLUMNS=200
python3 -m pip install --no-deps --no-build-isolation -q -e . > /dev/null 2>&1
python3 -c "from minillm.ops.build import load_extension as ok; print('cuda ops:', bool(ok()))"
for shape in "256 1024" "64 512" "8 2048"; do
  set -- $shape
  for a in "" "--async-scheduling"; do
    python3 scripts/profile_decode.py --batch "$1" --context "$2" --steps 30 $a \
      --output "$OUT/profile_b$1_c$2${a:+_async}.json" 2>&1 | head -16
  done
done
python3 -m minillm bench --no-progress --output "$OUT/bench.jsonl" 2>&1 | tail -6
python3 -m minillm bench --no-progress --set runtime.async_scheduling=true \
  --output "$OUT/bench.jsonl" 2>&1 | tail -6
python3 -m minillm latency-sweep --no-progress --rates 8 --configs chunked-2048 \
  --output "$OUT/latency.jsonl" --plot /tmp/latency_a.png 2>&1 | tail -6
python3 -m minillm latency-sweep --no-progress --rates 8 --configs chunked-2048 \
  --set runtime.async_scheduling=true --output "$OUT/latency.jsonl" --plot /tmp/latency_b.png 2>&1 | tail -6
