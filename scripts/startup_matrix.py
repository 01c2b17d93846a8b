"""GPU start-up matrix: every configuration validation accepts must serve, or be refused up front with a
ConfigError naming the key. Each case runs in its own process (a crash cannot leak into the next one):
LLM(model, load_format="dummy", device="cuda", ...) generates a few tokens (two prompts at once, then the same
prompt again for a prefix-cache hit).

    python scripts/startup_matrix.py --out results/startup_matrix.jsonl [--quick] [--jobs 4] [--shard 1/2]

Axes: dtype {bfloat16, float16, float32} x block_size {8, 16, 32, 64} x kernels.backend {auto, cuda, torch} x
enforce_eager {on, off} x prefix cache {on, off} x kv_cache_dtype {auto, fp8, fp8_e5m2} on qwen3-0.6b, plus every preset with its defaults. --quick runs a
pairwise design (every pair of values of two axes appears in some case) plus the three configurations that once
crashed in graph capture. One JSON line per case: the config, result (ok | refused | crashed), message, the plan's
record (minillm/runner/plan.py), the engine's warnings and errors (log), seconds. Exit status 1 when a case crashed.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AXES = {"dtype": ("bfloat16", "float16", "float32"), "block_size": (8, 16, 32, 64),
        "kernels": ("auto", "cuda", "torch"), "enforce_eager": (True, False), "enable_prefix_caching": (True, False),
        "kv_cache_dtype": ("auto", "fp8", "fp8_e5m2")}
SMALL = dict(load_format="dummy", device="cuda", max_model_len=256, num_kv_blocks=128, max_num_seqs=4)
ONCE_CRASHED = ({"dtype": "float32"}, {"block_size": 8}, {"block_size": 64})
PROMPT = list(range(1, 71))   # more than one block at every block size: the second run hits the prefix cache


def full_design() -> list[dict]:
    return [dict(zip(AXES, values)) for values in itertools.product(*AXES.values())]


def pairwise_design() -> list[dict]:
    """A greedy all-pairs cover of AXES: each new case is the full-product case covering the most uncovered
    pairs (ties: the first in product order), until every pair of two axes' values appears."""
    names = list(AXES)
    uncovered = {((a, va), (b, vb)) for a, b in itertools.combinations(names, 2) for va in AXES[a] for vb in AXES[b]}
    pool, chosen = full_design(), []
    while uncovered:
        def gain(case):
            return sum(((a, case[a]), (b, case[b])) in uncovered for a, b in itertools.combinations(names, 2))
        best = max(pool, key=gain)
        chosen.append(best)
        uncovered -= {((a, best[a]), (b, best[b])) for a, b in itertools.combinations(names, 2)}
    return chosen


def preset_cases() -> list[dict]:
    sys.path.insert(0, str(ROOT))
    from minillm.model.loader import preset_names

    return [{"model": name} for name in preset_names()]   # (the preset's model overrides the matrix's)


def cases(quick: bool, model: str = "qwen3-0.6b", device: str = "cuda") -> list[dict]:
    design = pairwise_design() if quick else full_design()
    extra = [c for c in ONCE_CRASHED if c not in design]
    return [{"model": model, "device": device, **c} for c in design + extra + preset_cases()]


class _Logged(logging.Handler):
    """The engine's warnings and errors of one case (the plan's one-line notice; a failed capture's error)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname}: {record.getMessage()}")


def run_case(case: dict) -> dict:
    """In this process: build the engine, generate, report. Never raises."""
    logged = _Logged()
    logging.getLogger("minillm").addHandler(logged)
    sys.path.insert(0, str(ROOT))
    from minillm.config import ConfigError
    from minillm.llm import LLM
    from minillm.sampling_params import SamplingParams

    t0 = time.perf_counter()
    kw = {k: v for k, v in case.items() if k != "model"}
    out = {"config": case}
    try:
        llm = LLM(case["model"], **{**SMALL, **kw})
        out["plan"] = llm.engine.runner.plan.record()
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        first = llm.generate([PROMPT, PROMPT[:40]], params, use_tqdm=False)
        again = llm.generate([PROMPT], params, use_tqdm=False)
        tokens = [len(o.token_ids) for o in first + again]
        ok = tokens == [6, 6, 6]
        # Recorded, not required: the repeat runs alone and hits the prefix cache, so its GEMMs and attention
        # see other shapes; on random (dummy) weights bf16 near-ties then pick other greedy tokens. Agreement with
        # HF is the end-to-end tests' job, with their near-tie rule.
        out.update(result="ok" if ok else "crashed", message="served" if ok else f"wrong output: tokens {tokens}",
                   greedy_repeat_equal=first[0].token_ids == again[0].token_ids)
    except ConfigError as e:
        out.update(result="refused", message=str(e))
    except Exception as e:   # noqa: BLE001 (a traceback is a failed case, reported as such)
        out.update(result="crashed", message=f"{type(e).__name__}: {e}",
                   traceback=traceback.format_exc()[-4000:])
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["log"] = logged.lines
    return out


def run_in_subprocess(case: dict, timeout: float) -> dict:
    t0 = time.perf_counter()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(case)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"config": case, "result": "crashed", "message": f"timed out after {timeout} s",
                "seconds": round(time.perf_counter() - t0, 2)}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if lines:
        result = json.loads(lines[-1])
    else:
        result = {"config": case, "result": "crashed",
                  "message": f"exit status {proc.returncode} without a result: {proc.stderr[-2000:]}"}
    result["stderr_tail"] = proc.stderr[-1500:]
    result["process_seconds"] = round(time.perf_counter() - t0, 2)
    return result


def preload_extension() -> None:
    """Build (or load from its cache) the CUDA extension once, so that no case pays for the build."""
    subprocess.run([sys.executable, "-c", "from minillm.ops.build import load_extension; load_extension()"],
                   cwd=ROOT, check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="JSON lines appended here")
    ap.add_argument("--quick", action="store_true", help="a pairwise design instead of the full product")
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once (each in its own process)")
    ap.add_argument("--shard", default="1/1", help="K/N: run the K-th of N equal slices of the cases")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    ap.add_argument("--model", default="qwen3-0.6b", help="the model of the matrix (presets run as well)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script only")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(run_case(json.loads(args.child))), flush=True)
        return 0
    if args.out is None:
        ap.error("--out is required")
    k, n = (int(x) for x in args.shard.split("/"))
    todo = cases(args.quick, args.model, args.device)[k - 1::n]
    if args.device == "cuda":
        preload_extension()
    sys.path.insert(0, str(ROOT))
    from minillm.fingerprint import stamp

    crashed = 0
    with ThreadPoolExecutor(max(1, args.jobs)) as pool, args.out.open("a") as f:
        for res in pool.map(lambda c: run_in_subprocess(c, args.timeout), todo):
            crashed += res["result"] == "crashed"
            f.write(json.dumps({"kind": "startup_matrix", **stamp(), **res}) + "\n")
            f.flush()
            print(f"{res['result']:8} {res.get('seconds', '-'):>7} s  {json.dumps(res['config'])}  "
                  f"{res['message'][:160]}", flush=True)
    print(f"{len(todo)} cases, {crashed} crashed -> {args.out}")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
