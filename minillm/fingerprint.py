"""Where a measurement was taken: GPU fingerprint and git commit, stamped onto every results line."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=1)
def git_commit() -> str:
    """Short commit of the working tree, with '+dirty' when uncommitted changes exist; 'unknown' outside git.
    MINILLM_COMMIT overrides it, for copies of the tree that travel without their .git (a remote GPU box)."""
    if os.environ.get("MINILLM_COMMIT"):
        return os.environ["MINILLM_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("+dirty" if dirty else "")) if sha else "unknown"


def _nvidia_smi(fields: str) -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []
    return [x.strip() for x in out.split(",")] if out else []


@lru_cache(maxsize=1)
def gpu_fingerprint() -> dict:
    """Name, memory, clocks, power limit, driver, torch and CUDA versions; {"gpu": None} without a GPU."""
    import torch

    info: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                  "host_cpu": platform.processor() or platform.machine()}
    if not torch.cuda.is_available():
        info["gpu"] = None
        return info
    props = torch.cuda.get_device_properties(0)
    info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                sm_count=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
    keys = ["driver", "sm_clock_max_mhz", "mem_clock_max_mhz", "power_limit_w"]
    vals = _nvidia_smi("driver_version,clocks.max.sm,clocks.max.mem,power.limit")
    info.update(dict(zip(keys, vals)))
    return info


def stamp() -> dict:
    """Fields every results/*.jsonl line carries."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "fingerprint": gpu_fingerprint()}
