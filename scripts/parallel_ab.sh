#!/usr/bin/env bash
# TP=1 / DP=1 must cost nothing: the same offline `minillm bench` on this tree and on the tree before the parallel
# work (BASE), interleaved A B A B ... in one run on one GPU, into one JSONL per tree.
#
#   OUT=results/ab scripts/parallel_ab.sh                 # BASE = cbe3b49 (git worktree), 3 rounds, 256 requests
#   OUT=results/ab BASE_TREE=/path/to/old/checkout ROUNDS=5 scripts/parallel_ab.sh
#
# Writes $OUT/ab_new.jsonl and $OUT/ab_base.jsonl (one bench row per round) and prints the output tok/s of each
# round and the median of each tree. The extension of each tree is built once, before anything is timed.
set -euo pipefail
: "${OUT:?set OUT to the folder the results go to}"
BASE=${BASE:-cbe3b49}
ROUNDS=${ROUNDS:-3}
REQUESTS=${REQUESTS:-256}
cd "$(dirname "$0")/.."
NEW_TREE=$PWD
mkdir -p "$OUT"
if [ -z "${BASE_TREE:-}" ]; then
    BASE_TREE=$OUT/base-tree
    [ -d "$BASE_TREE" ] || git worktree add --detach "$BASE_TREE" "$BASE" > "$OUT/worktree.log" 2>&1
fi
export PYTHONUNBUFFERED=1
run() {   # run TREE LABEL ROUND (the base tree's lines name BASE as their commit)
    local commit=${MINILLM_COMMIT:-}
    [ "$2" = base ] && commit=$BASE
    (cd "$1" && MINILLM_COMMIT=$commit MINILLM_EXT_DIR=$1/.ext PYTHONPATH=$1${PYTHONPATH:+:$PYTHONPATH} python3 -m minillm bench --num-requests "$REQUESTS" \
        --no-progress -o "$OUT/ab_$2.jsonl" > "$OUT/bench_$2_$3.log" 2>&1)
}
for tree in "$NEW_TREE" "$BASE_TREE"; do   # build each extension once, untimed
    (cd "$tree" && MINILLM_EXT_DIR=$tree/.ext PYTHONPATH=$tree python3 -c \
        "from minillm.ops.build import load_extension; load_extension()" > /dev/null 2>&1) || true
done
for i in $(seq 1 "$ROUNDS"); do
    run "$NEW_TREE" new "$i"
    run "$BASE_TREE" base "$i"
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
for label in ("new", "base"):
    rows = [json.loads(l) for l in (out / f"ab_{label}.jsonl").read_text().splitlines() if l.strip()]
    tok = [r.get("output_tok_s") or r.get("output_tokens_per_s") for r in rows]
    print(f"{label:>5}: output tok/s per round {tok}; median {statistics.median([t for t in tok if t])}")
PY
