"""scripts/profile_decode.py runs end to end (tiny demo model on the CPU) and reports a consistent breakdown."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_decode.py"


def test_profile_decode_smoke(tmp_path):
    out = tmp_path / "p.json"
    subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--batch", "4", "--context", "24", "--steps",
                    "3", "--output", str(out)], check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    assert res["wall_ms_per_step"] > 0 and res["profiled_wall_ms_per_step"] > 0
    assert 0 < res["busy_ms_per_step"] <= res["profiled_wall_ms_per_step"]
    assert 0 <= res["idle_ms_per_step"] < res["profiled_wall_ms_per_step"]
    # the busy time is a union of intervals: never more than the sum of the events in it
    assert res["busy_ms_per_step"] <= res["kernel_sum_ms_per_step"] * 1.0001
    cats = res["by_category_ms"]
    assert cats and all(v >= 0 for v in cats.values()) and max(cats.values()) > 0
    assert res["kernels"]["source"] == "cpu aten ops" and res["kernels"]["steps"] == 3
    assert res["host_phases"]["steps"] == 3
