"""Percentiles and latency summaries on hand-made timestamps."""
import numpy as np
import pytest

from minillm.bench.stats import RequestTimeline, latency_summary, percentile


def test_percentile_known_values():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(4.6)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    rng = np.random.default_rng(3)
    sample = rng.random(101).tolist()
    for q in (1, 37.5, 99):
        assert percentile(sample, q) == pytest.approx(float(np.percentile(sample, q)))
    with pytest.raises(ValueError, match="q="):
        percentile(xs, 101)


def test_latency_summary_on_known_timestamps():
    a = RequestTimeline(arrival=0.0, token_times=[0.5, 0.6, 0.8])     # ttft 0.5, itl 0.1, 0.2
    b = RequestTimeline(arrival=1.0, token_times=[1.1, 1.5])          # ttft 0.1, itl 0.4
    s = latency_summary([a, b])
    assert s["ttft_p50_s"] == pytest.approx(0.3)
    assert s["ttft_p99_s"] == pytest.approx(0.1 + 0.4 * 0.99)
    assert s["itl_p50_s"] == pytest.approx(0.2)
    assert s["itl_max_s"] == pytest.approx(0.4)
    # the worst gaps, largest first, each with the time of its end from the first arrival (0.0)
    assert s["itl_worst_s"] == [pytest.approx([0.4, 1.5]), pytest.approx([0.2, 0.8]), pytest.approx([0.1, 0.6])]
    assert s["itl_p99_s"] == pytest.approx(0.2 + 0.2 * 0.98)
    assert s["output_tokens"] == 5
    assert s["output_tok_s"] == pytest.approx(5 / 1.5)


def test_latency_summary_without_tokens_reports_missing():
    s = latency_summary([RequestTimeline(arrival=0.0)])
    assert s["ttft_p99_s"] is None and s["itl_max_s"] is None and s["output_tok_s"] is None
