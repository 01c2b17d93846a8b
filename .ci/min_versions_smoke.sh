#!/usr/bin/env bash
# The dependency floors, tested: a fresh venv (no system site-packages) with torch 2.13.0 and every runtime
# dependency at the version .ci/min-versions.txt pins (pyproject.toml's lower bounds), minillm installed from this
# tree (not editable); then, from another directory: every command's --help, `generate` on the demo model, `serve`
# answering a completion, a streamed chat completion and /metrics, and `latency-sweep --target` against it. Exit 0
# only if every step passed.
# Usage: .ci/min_versions_smoke.sh   (MIN_VERSIONS_VENV picks the venv folder; default .venv-min)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
venv=${MIN_VERSIONS_VENV:-$repo/.venv-min}

python3 -m venv --clear "$venv"
py="$venv/bin/python"
"$py" -m pip install -q "torch==2.13.0"
"$py" -m pip install -q -c .ci/min-versions.txt "$repo"
"$py" -m pip check
"$py" - .ci/min-versions.txt <<'EOF'
import sys
from importlib.metadata import version
pins = [line.split("==") for line in open(sys.argv[1]) if "==" in line and not line.startswith("#")]
wrong = [f"{name} {version(name)} (floor {floor.strip()})" for name, floor in pins if version(name) != floor.strip()]
print("floors installed:", ", ".join(f"{n}=={f.strip()}" for n, f in pins))
sys.exit(f"not at the floor: {wrong}" if wrong else 0)
EOF

work=$(mktemp -d)
server=
trap '[ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$work"' EXIT
cd "$work"   # nothing may come from the source tree
mll="$venv/bin/minillm"

for cmd in "" generate serve-stdin bench latency-sweep check-kernels serve; do
  "$mll" $cmd --help > help.txt || { cat help.txt; echo "FAILED: minillm $cmd --help"; exit 1; }
done
echo "ok      every command's --help"

printf '%s\n' '{"id": "a", "prompt": "Hello", "max_tokens": 4, "temperature": 0}' > in.jsonl
OMP_NUM_THREADS=1 "$mll" generate in.jsonl -o out.jsonl --device cpu
"$py" -c "import json; line = json.loads(open('out.jsonl').readline()); assert line['id'] == 'a' and 'text' in str(line), line"
echo "ok      generate on the demo model"

OMP_NUM_THREADS=1 "$mll" serve --port 0 --device cpu 2> serve.err &
server=$!
"$py" <<'EOF'
import json, re, sys, time, urllib.request
deadline = time.time() + 120
while not (m := re.search(r"ready on (http://\S+)", open("serve.err").read())):
    if time.time() > deadline:
        sys.exit("serve did not become ready:\n" + open("serve.err").read())
    time.sleep(0.2)
url = m.group(1)
def post(path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=60)
with post("/v1/completions", {"model": "minillm-demo", "prompt": "Hello", "max_tokens": 4, "temperature": 0}) as r:
    answer = json.load(r)
assert answer["choices"][0]["finish_reason"] in ("length", "stop"), answer
chat = {"model": "minillm-demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
with post("/v1/chat/completions", chat) as r:   # the chat template (jinja2) and SSE streaming
    events = [line for line in r.read().decode().splitlines() if line.startswith("data: ")]
assert events[-1] == "data: [DONE]" and len(events) >= 3, events
with urllib.request.urlopen(url + "/metrics", timeout=30) as r:   # prometheus_client
    assert "minillm_" in r.read().decode()
open("url.txt", "w").write(url)
EOF
echo "ok      serve: a completion, a streamed chat completion, /metrics"
# latency-sweep against the server: httpx on the client side, rich tables, the matplotlib figure.
OMP_NUM_THREADS=1 "$mll" latency-sweep --target "$(cat url.txt)" --model demo --num-requests 2 --rates 8 \
  --time-scale 0.01 --configs chunked-512 -o lat.jsonl --plot lat.png --no-progress > sweep.txt 2>&1 \
  || { cat sweep.txt; echo "FAILED: latency-sweep --target"; exit 1; }
[ -s lat.jsonl ] && [ -s lat.png ] || { cat sweep.txt; echo "FAILED: latency-sweep wrote no results"; exit 1; }
echo "ok      latency-sweep --target the server (JSONL and PNG)"
kill -TERM "$server"
rc=0; wait "$server" || rc=$?
server=
[ "$rc" -eq 0 ] || { cat serve.err; echo "FAILED: serve exited $rc after SIGTERM"; exit 1; }
echo "ok      serve exits 0 on SIGTERM"

# The floor of typer beside the newest click (what pip gives a user who upgrades click alone).
"$py" -m pip install -q --upgrade click
for cmd in "" generate serve-stdin bench latency-sweep check-kernels serve; do
  "$mll" $cmd --help > help.txt || { cat help.txt; echo "FAILED: minillm $cmd --help with the newest click"; exit 1; }
done
echo "ok      every command's --help with typer $("$py" -c 'import typer; print(typer.__version__)') and click $("$py" -c 'from importlib.metadata import version; print(version("click"))')"
