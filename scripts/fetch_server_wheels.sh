#!/usr/bin/env bash
# Download the wheels `minillm serve`, `latency-sweep --target` and the HTTP tests need, for a machine without
# network access (CPython 3.12, manylinux x86_64), into .whl/ (git-ignored). scripts/http_latency.py installs
# them from there when they are missing:
#     python3 -m pip install --no-index --find-links .whl fastapi uvicorn prometheus_client httpx openai uvloop httptools
#
# The list is the dependency closure of fastapi, uvicorn, prometheus_client, httpx and openai on Linux/CPython 3.12,
# pinned to the versions the project is tested with, plus uvloop and httptools: uvicorn uses them when present, and
# they cut the event loop's CPU per streamed chunk (the HTTP tests pass with and without them). Pure-Python
# packages ship one py3-none-any wheel, which a manylinux platform filter does not match: those are fetched with
# `--platform any`.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
mkdir -p "$DEST"

PINS=(
    annotated-doc==0.0.7 annotated-types==0.7.0 anyio==4.16.0 certifi==2026.5.20 click==8.5.1
    fastapi==0.165.0 h11==0.16.0 httpcore==1.0.9 httpcore2==2.16.2 httpx==0.28.1 httpx2==2.16.2 idna==3.20
    jiter==0.19.0 openai==3.57.0 opentelemetry-api==1.45.2 prometheus_client==0.26.0 pydantic==2.13.4
    pydantic_core==2.46.4 sniffio==1.3.1 starlette==1.10.0 truststore==0.10.5 typing_extensions==4.16.0
    typing-inspection==0.4.2 uvicorn==0.54.0
    httptools==0.9.0 uvloop==0.23.0
)

fetch() {   # $1: NAME==VERSION; $2...: platform flags
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${@:2}" -d "$DEST" "$1"
}

failed=()
for pin in "${PINS[@]}"; do
    fetch "$pin" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 2>/dev/null \
        || fetch "$pin" --platform any \
        || failed+=("$pin")
done
ls "$DEST"
if [ ${#failed[@]} -gt 0 ]; then
    echo "could not download: ${failed[*]}" >&2
    exit 1
fi
echo "all ${#PINS[@]} wheels are in $DEST"
