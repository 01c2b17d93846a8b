"""The decode-step sweep (minillm/bench/decode_sweep.py): its floor arithmetic against a direct count, and one
tiny run end to end on the CPU (the timings mean nothing there; the lines and the figure must be right)."""
import json

import pytest

from minillm.bench.decode_sweep import line_model, plot_decode_steps, run_decode_sweep, step_floor_ms
from minillm.bench.floor import DeviceRates, ModelShape
from minillm.config import EngineConfig

QWEN3_06B = ModelShape(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128)


def test_floor_of_a_b1_step_is_the_weights_plus_its_kv():
    # B=1 on the H200 at 4.22 TB/s: 1.19 GB of weights (0.28 ms) plus ~384 tokens x 112 KiB of KV
    ms = step_floor_ms(QWEN3_06B, "torch.bfloat16", 1, 128, 512, 4.22e12)
    assert ms == pytest.approx(0.29, abs=0.01)
    # B=256: the KV dominates; counted token by token
    kv = sum(256 * (128 + k) for k in range(1, 512)) / 511 * 112 * 1024
    assert step_floor_ms(QWEN3_06B, "bfloat16", 256, 128, 512, 4.22e12) == pytest.approx(
        (QWEN3_06B.step_weight_bytes(2) + kv) / 4.22e12 * 1e3)
    assert step_floor_ms(QWEN3_06B, "bfloat16", 4, 128, 512, None) is None


def test_sweep_runs_end_to_end_and_plots(tmp_path):
    cfg = EngineConfig.from_kwargs(device="cpu", dtype="float32")
    lines = run_decode_sweep(cfg, DeviceRates(None, None, 0.0), batch_sizes=(1, 3), prompt_len=8, out_tokens=6)
    assert [ln["batch_size"] for ln in lines] == [1, 3]
    for ln in lines:
        assert ln["kind"] == "decode_step" and len(ln["ms_per_step_runs"]) == 2 and ln["floor_ms"] is None
        assert ln["model"] == "demo" == line_model(ln)
        assert ln["kernels"]["cuda_ops"] is False and ln["config"]["cache"]["enable_prefix_caching"] is False
        json.dumps(ln)
    stamped = [{**ln, "commit": c, "date": d} for c, d in (("aaa", "2026-01-01"), ("bbb", "2026-01-02"))
               for ln in lines]
    plot_decode_steps(stamped, tmp_path / "d.png")
    assert (tmp_path / "d.png").stat().st_size > 1000
    other = [{**ln, "model": "qwen3-30b-a3b", "commit": "ccc", "date": "2026-01-03"} for ln in lines]
    plot_decode_steps(stamped + other, tmp_path / "m.png", model="demo")   # the other model's are left out
    with pytest.raises(ValueError, match="no decode_step lines"):
        plot_decode_steps(other, tmp_path / "n.png", model="demo")


def test_older_lines_name_their_model_in_the_config():
    assert line_model({"config": {"model": {"model": "qwen3-8b"}}}) == "qwen3-8b"
    assert line_model({"model": "qwen3-0.6b", "config": {"model": {"model": "x"}}}) == "qwen3-0.6b"
    assert line_model({"config": {"model": {"model": None}}}) == "demo"
