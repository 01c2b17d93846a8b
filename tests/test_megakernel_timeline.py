"""The megakernel timeline analysis (minillm/bench/megakernel_timeline.py) on synthetic stamps with known costs."""
import pytest
import torch

from minillm.bench import megakernel_timeline as tl
from minillm.ops import megakernel as mkops


def synthetic(num_layers: int, ctas: int, step_ns, late_cta: int, late_ns: int, ghz: float = 1.8):
    """Stamps of a launch where step i of every layer takes step_ns[i] on every CTA, except that CTA late_cta is
    late_ns slower in attention (so it arrives last at that barrier and waits less there), each CTA with its own
    clock64 origin."""
    p = len(tl.POINTS)
    buf = torch.zeros(num_layers * p + 1, ctas, 2, dtype=torch.int64)
    t = 1_000_000
    for layer in range(num_layers):
        for point in range(p):
            for c in range(ctas):
                extra = late_ns if (c == late_cta and point == 6) else 0   # attn_arrive later
                ns = t + extra
                buf[layer * p + point, c, 1] = ns
                buf[layer * p + point, c, 0] = int(ns * ghz) + 7919 * c
            t += step_ns[point]
    for c in range(ctas):
        buf[num_layers * p, c, 1] = t
        buf[num_layers * p, c, 0] = int(t * ghz) + 7919 * c
    return buf.view(-1)


def test_steps_and_barriers_recovered():
    step_ns = [300 + 100 * i for i in range(len(tl.POINTS))]
    s = tl.analyze(synthetic(6, 5, step_ns, late_cta=3, late_ns=200), 6, 5)
    for (name, a, b), ns in zip(tl.STEPS, step_ns):
        assert s["steps"][name]["median_us"] == pytest.approx(ns / 1e3, abs=2e-3), name
    assert s["steps"]["attn.items"]["max_us"] == pytest.approx((step_ns[5] + 200) / 1e3, abs=2e-3)
    assert s["steps"]["attn.barrier"]["median_us"] == pytest.approx(step_ns[6] / 1e3, abs=2e-3)
    assert s["barriers"]["attn"]["imbalance_us"] == pytest.approx(0.2, abs=2e-3)
    assert s["barriers"]["attn"]["latency_us"] == pytest.approx((step_ns[6] - 200) / 1e3, abs=2e-3)
    assert s["barriers"]["qkv"]["imbalance_us"] == pytest.approx(0.0, abs=1e-6)
    assert s["layer_us"] == pytest.approx(sum(step_ns) / 1e3, abs=2e-3)
    assert sum(tl.phase_totals(s).values()) == pytest.approx(s["layer_us"], abs=2e-3)
    assert s["clock_ghz"] == pytest.approx(1.8, rel=1e-3)
    assert s["layers_averaged"] == 4
    assert "attn.items" in tl.format_summary(s)


def test_buffer_size_matches_the_kernel_layout():
    assert len(tl.POINTS) == mkops.PROF_POINTS
    with pytest.raises(ValueError, match="words"):
        tl.analyze(torch.zeros(10, dtype=torch.int64), 4, 3)
    with pytest.raises(ValueError, match="not increasing"):
        tl.analyze(torch.zeros((4 * mkops.PROF_POINTS + 1) * 3 * 2, dtype=torch.int64), 4, 3)


def test_step_names_cover_every_point_once():
    starts = sorted(a for _, a, _ in tl.STEPS)
    assert starts == list(range(len(tl.POINTS)))
    assert all(b == a + 1 for _, a, b in tl.STEPS)


def test_categories_add_up_and_figure_is_drawn(tmp_path):
    step_ns = [300 + 100 * i for i in range(len(tl.POINTS))]
    s = tl.analyze(synthetic(5, 4, step_ns, late_cta=1, late_ns=100), 5, 4)
    cats = tl.category_totals(s)
    assert sum(cats.values()) == pytest.approx(s["layer_us"], abs=2e-3)
    assert cats["grid barrier wait"] == pytest.approx(sum(step_ns[i] for i in (4, 6, 10, 15, 19)) / 1e3, abs=2e-3)
    lines = [dict(kind="timeline", batch=b, context=128, date="2026-12-01", commit="x", **s) for b in (1, 8)]
    out = tmp_path / "t.png"
    tl.plot_timelines(lines, out, weight_floor_us=7.5)
    assert out.stat().st_size > 1000
    with pytest.raises(ValueError):
        tl.plot_timelines([], out)
