"""scripts/structured_bench.py gpu_timeline: the GPU's busy fraction and stalls from each step's four timing events."""
import importlib.util
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


class Mark:
    def __init__(self, ms: float):
        self.ms = ms

    def elapsed_time(self, later: "Mark") -> float:
        return later.ms - self.ms


def test_gpu_timeline_splits_each_step_into_forward_stall_sampler_and_gap():
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("structured_bench", SCRIPTS / "structured_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # three steps: forward 1.2 ms, then 0.5 / 0.0 / 0.3 ms waiting for the mask, sampler 0.2 ms, 0.1 ms gaps
    events, t = [], 0.0
    for stall in (0.5, 0.0, 0.3):
        events.append((Mark(t), Mark(t + 1.2), Mark(t + 1.2 + stall), Mark(t + 1.4 + stall)))
        t += 1.4 + stall + 0.1
    out = bench.gpu_timeline(events)
    span = 3 * 1.4 + 0.8 + 2 * 0.1
    assert out["gpu_steps"] == 3 and out["gpu_span_ms"] == pytest.approx(span)
    assert out["gpu_busy_fraction_events"] == pytest.approx(3 * 1.4 / span)
    assert out["gpu_forward_ms_median"] == pytest.approx(1.2)
    assert out["gpu_mask_stall_ms_median"] == pytest.approx(0.3)
    assert out["gpu_sampler_ms_median"] == pytest.approx(0.2)
    assert out["gpu_gap_ms_median"] == pytest.approx(0.1)
    assert bench.gpu_timeline(events[:2]) == {}


def test_host_clock_counts_blocked_time_and_masks_time_without_it():
    spec = importlib.util.spec_from_file_location("structured_bench", SCRIPTS / "structured_bench.py")
    sys.path.insert(0, str(SCRIPTS))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    clock = bench.HostClock()
    busy = lambda s: time.sleep(s)   # noqa: E731 - stands in for host work
    wait = clock.blocking(lambda: time.sleep(0.05))

    def masks():
        busy(0.02)
        wait()
        return "mask"

    assert clock.in_masks(masks)() == "mask"
    blocked, parts = clock.read()
    assert 0.05 <= blocked < 0.09
    assert 0.02 <= parts["masks"] < 0.045   # the wait inside it is not masks time
    inner = clock.part("inner", lambda: busy(0.01))
    clock.part("outer", lambda: (busy(0.01), inner(), wait()))()
    parts = clock.read()[1]
    assert 0.01 <= parts["inner"] < 0.025
    assert 0.02 <= parts["outer"] < 0.045   # nested parts are counted in both; waits in neither
    with pytest.raises(ValueError):
        clock.blocking(lambda: (_ for _ in ()).throw(ValueError("x")))()
    assert clock.read()[0] > blocked   # a wait that raised still counts
