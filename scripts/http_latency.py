#!/usr/bin/env python3
"""Online latency through `minillm serve` against the in-process sweep: same config, workload and rates.

    python3 scripts/http_latency.py                       # chunked-2048 of configs/latency.yaml, 4 and 8 req/s
    python3 scripts/http_latency.py --config-name prefill-first --rates 8

1. Installs the server's wheels from .whl/ (scripts/fetch_server_wheels.sh) if fastapi, uvicorn, prometheus_client,
   httpx (or uvloop, httptools) is missing, and builds the CUDA extension once, before anything is timed.
2. Writes the suite entry's resolved engine config to a YAML file (with parallel.engine_process as
   --engine-process says: true = the engine core in its own process behind ZMQ, false = the engine thread in
   the server's process), starts `minillm serve --config` on it in the background and waits for /health.
3. `minillm latency-sweep --target` replays the online workload against it (a separate client process).
4. Stops the server with SIGTERM (it must exit 0), then runs the in-process `minillm latency-sweep` with the same
   config and rates.
Both append to one JSONL file (default results/latency_http.jsonl), told apart by `transport` (http / in-process);
a side-by-side table closes the run. Logs and the server config go next to it. Exit status 1 if any step failed.

    python3 scripts/http_latency.py --engine-process both   # also the engine-thread server, into *_thread.jsonl
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVER_MODULES = ("fastapi", "uvicorn", "prometheus_client", "httpx")
SPEEDUPS = ("uvloop", "httptools")   # used by uvicorn when present; installed from .whl/ if it has them
READY = re.compile(r"ready on (http://\S+)")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config-name", default="chunked-2048", help="a config of the suite (configs/latency.yaml)")
    p.add_argument("--rates", default="4,8")
    p.add_argument("--output", type=Path, default=Path("results/latency_http.jsonl"))
    p.add_argument("--suite", type=Path, default=REPO / "configs" / "latency.yaml")
    p.add_argument("--engine-config", type=Path, help="engine YAML instead of the suite's engine section")
    p.add_argument("--device", help="engine device (default: the config's)")
    p.add_argument("--workload", type=Path, help="workload YAML instead of the suite's (small runs)")
    p.add_argument("--num-requests", type=int)
    p.add_argument("--time-scale", type=float)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--engine-process", choices=("true", "false", "both"), default="true",
                   help="the server's parallel.engine_process; both = a second HTTP run with the engine thread")
    return p.parse_args()


def _ensure_server_wheels() -> None:
    wheels = REPO / ".whl"
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing and not wheels.is_dir():
        sys.exit(f"missing {', '.join(missing)} and no .whl/ to install them from: run scripts/fetch_server_wheels.sh "
                 "on a machine with network access and bring .whl/ along")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels)]
    if missing:
        subprocess.run([*pip, *missing], check=True)
    speedups = [m for m in SPEEDUPS if importlib.util.find_spec(m) is None and any(wheels.glob(f"{m}-*.whl"))]
    if speedups and subprocess.run([*pip, *speedups]).returncode != 0:
        print(f"could not install {', '.join(speedups)}: serving on asyncio + h11", flush=True)


def _server_config(args, out_dir: Path, engine_process: bool) -> Path:
    """The suite entry resolved exactly as latency-sweep resolves it, as an engine config file for `serve`."""
    import yaml

    from minillm.bench.suite import fit_workload, online_workload, pick_configs, read_suite

    suite = read_suite(args.suite)
    workload = online_workload(suite, args.workload, args.num_requests)
    (entry,) = pick_configs(suite.get("configs"), args.config_name)
    _, cfg, _ = fit_workload(workload, suite, args.engine_config, [], {"device": args.device}, entry)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, engine_process=engine_process))
    path = out_dir / f"serve_{args.config_name}_{'process' if engine_process else 'thread'}.yaml"
    path.write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    return path


def _sweep_args(args, out_dir: Path, tag: str, output: Path) -> list[str]:
    cmd = ["latency-sweep", "--suite", str(args.suite), "--configs", args.config_name, "--rates", args.rates,
           "--output", str(output), "--plot", str(out_dir / f"latency_{tag}.png"), "--no-progress"]
    for flag, value in (("--config", args.engine_config), ("--device", args.device), ("--workload", args.workload),
                        ("--num-requests", args.num_requests), ("--time-scale", args.time_scale)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd


def _minillm(cmd: list[str], log: Path) -> int:
    with log.open("w") as f:
        return subprocess.run([sys.executable, "-m", "minillm", *cmd], stdout=f, stderr=subprocess.STDOUT,
                              cwd=REPO).returncode


def _start_server(config: Path, log: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    f = log.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--config", str(config), "--port", "0",
                             "--log-level", "warning"], stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = READY.search(log.read_text())
        if m:
            url = m.group(1)
            with urllib.request.urlopen(url + "/health", timeout=10) as r:
                if r.status == 200:
                    return proc, url
        if proc.poll() is not None:
            sys.exit(f"minillm serve exited with {proc.returncode} before it was ready; see {log}")
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"minillm serve was not ready after {timeout:.0f} s; see {log}")


def _side_by_side(path: Path, label: str, since: int) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines()[since:] if line.strip()]
    rows = [r for r in rows if r.get("kind") == "latency" and r.get("label") == label]
    keys = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "itl_max_s")
    print(f"\n{label}: HTTP against in-process (ms; out tok/s)")
    print(f"{'rate':>5} {'transport':>11} " + " ".join(f"{k[:-2]:>10}" for k in keys) + f" {'tok/s':>8}")
    for r in sorted(rows, key=lambda r: (r["rate"], r.get("transport") != "http")):
        cells = " ".join(f"{r[k] * 1e3:10.1f}" if r[k] is not None else f"{'-':>10}" for k in keys)
        print(f"{r['rate']:5g} {r.get('transport', '?'):>11} {cells} {r['output_tok_s'] or 0:8.0f}")
    _where_ttft_went(rows)


def _where_ttft_went(rows: list[dict]) -> None:
    """Mean TTFT in-process, over HTTP as the client saw it and as the server stamped it, the server's admission
    time (arrival to the engine taking the request) and how late the client sent: where the HTTP TTFT went."""
    keys = ("ttft_mean_s", "server_ttft_mean_s", "server_admission_mean_s", "client_send_lag_p50_s")
    local = {r["rate"]: r.get("ttft_mean_s") for r in rows if r.get("transport") == "in-process"}
    http = sorted((r for r in rows if r.get("transport") == "http"), key=lambda r: r["rate"])
    if not http:
        return

    def cell(v) -> str:
        return f"{v * 1e3:23.2f}" if v is not None else f"{'-':>23}"

    print(f"\n{'rate':>5} {'in-process ttft_mean':>23} " + " ".join(f"{k[:-2]:>23}" for k in keys) + "   (ms)")
    for r in http:
        print(f"{r['rate']:5g} {cell(local.get(r['rate']))} " + " ".join(cell(r.get(k)) for k in keys))


def main() -> int:
    args = _args()
    os.chdir(REPO)
    os.environ.setdefault("MINILLM_EXT_DIR", str(REPO / ".ext"))   # one extension build, reused by every process
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.path.insert(0, str(REPO))
    _ensure_server_wheels()
    out_dir = args.output.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    from minillm.ops.build import ExtensionError, load_extension
    try:   # build once, before anything is timed
        load_extension()
        print("cuda ops: built", flush=True)
    except ExtensionError as e:
        print(f"cuda ops: unavailable ({e})", flush=True)
    runs = {"true": [True], "false": [False], "both": [True, False]}[args.engine_process]
    outputs = [args.output if mode == runs[0] else args.output.with_name(args.output.stem + "_thread.jsonl")
               for mode in runs]
    since = {out: len(out.read_text().splitlines()) if out.is_file() else 0 for out in outputs}
    codes = []
    for mode, output in zip(runs, outputs):
        tag = "process" if mode else "thread"
        config = _server_config(args, out_dir, mode)
        proc, url = _start_server(config, out_dir / f"serve_{tag}.log", args.startup_timeout)
        print(f"server (engine {tag}) ready at {url}; HTTP sweep ...", flush=True)
        http_rc = _minillm(_sweep_args(args, out_dir, f"http_{tag}", output) + ["--target", url],
                           out_dir / f"sweep_http_{tag}.log")
        proc.send_signal(signal.SIGTERM)
        server_rc = proc.wait(120)
        print(f"HTTP sweep exit {http_rc}; server exit {server_rc} after SIGTERM", flush=True)
        _append_core_loops(out_dir / f"serve_{tag}.log", output, tag)
        codes += [http_rc, server_rc]
    print("in-process sweep ...", flush=True)
    local_rc = _minillm(_sweep_args(args, out_dir, "inprocess", outputs[0]), out_dir / "sweep_inprocess.log")
    print(f"in-process sweep exit {local_rc}")
    codes.append(local_rc)
    for output in outputs:
        _side_by_side(output, args.config_name, since[output])
    return 0 if all(c == 0 for c in codes) else 1

def _append_core_loops(server_log: Path, output: Path, tag: str) -> None:
    """The engine-core processes' exit lines (their step time by phase and by path: megakernel, graph, eager)
    as results lines next to the latency rows, so a run says where a slower core step went."""
    from minillm.bench.report import append_jsonl
    from minillm.engine.core_process import EXIT_LINE

    for line in server_log.read_text(errors="replace").splitlines():
        if line.startswith(EXIT_LINE):
            replica, _, summary = line[len(EXIT_LINE):].partition(": ")
            append_jsonl(str(output), {"kind": "engine_core_loop", "server": tag, "replica": int(replica),
                                       **json.loads(summary)})


if __name__ == "__main__":
    sys.exit(main())
