"""scripts/profile_decode.py runs end to end (tiny demo model on the CPU) and reports a consistent breakdown."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_decode.py"


def test_profile_decode_smoke(tmp_path):
    out = tmp_path / "p.json"
    subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--batch", "4", "--context", "24", "--steps",
                    "3", "--output", str(out)], check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    assert res["wall_ms_per_step"] > 0 and res["device_ms_per_step"] > 0
    assert abs(sum(res["by_category_ms"].values()) - res["device_ms_per_step"]) < 1e-6
    assert res["host_phases"]["steps"] == 3
