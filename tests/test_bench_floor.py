"""The floor formula reproduces the figures of docs/architecture.md section 7 on the offline reference."""
import pytest
import torch

from minillm.bench.floor import (DeviceRates, ModelShape, dtype_bytes, floor_record, floor_seconds,
                                 measure_copy_bandwidth, measure_gemm_rate, workload_work)
from minillm.bench.workloads import reference_offline

QWEN3_06B = ModelShape(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128)


def _reference_work():
    w = reference_offline()
    return workload_work(QWEN3_06B, [len(p) for p in w.prompts], w.max_tokens, dtype_bytes("bfloat16"), 256)


def test_design_section_7_numbers():
    assert QWEN3_06B.kv_bytes_per_token(2) == 112 * 1024
    assert QWEN3_06B.step_weight_bytes(2) / 1e9 == pytest.approx(1.19, abs=0.005)
    work = _reference_work()
    assert work.num_steps == 1024
    assert work.kv_bytes / 1e12 == pytest.approx(13.87, abs=0.005)
    assert work.weight_bytes / 1e12 == pytest.approx(1.22, abs=0.005)
    # at 4.23 TB/s copy and ~760 TFLOP/s GEMM, prefill is ~0.18 s and the floor 3.75 s (35.7k output tok/s)
    assert work.prefill_flops / 760e12 == pytest.approx(0.18, abs=0.005)
    floor = floor_seconds(work, 4.23e12, 760e12)
    assert floor == pytest.approx(3.75, abs=0.01)
    assert 133_966 / floor == pytest.approx(35.7e3, rel=0.01)


def test_step_count_bound_by_batch_size():
    work = workload_work(QWEN3_06B, [10, 10, 10], [5, 5, 5], 2, max_num_seqs=1)
    assert work.num_steps == 15
    assert work.kv_bytes == 3 * (5 * 10 + 10) * QWEN3_06B.kv_bytes_per_token(2)


def test_floor_record_fraction_and_nulls():
    work = _reference_work()
    rec = floor_record(work, DeviceRates(4.23e12, 760e12, 1.0), wall_s=7.5)
    assert rec["fraction_of_floor"] == pytest.approx(rec["floor_s"] / 7.5)
    cpu = floor_record(work, DeviceRates(None, None, 0.0), wall_s=7.5)
    assert cpu["floor_s"] is None and cpu["fraction_of_floor"] is None and cpu["kv_bytes"] == work.kv_bytes


def test_measurements_skip_without_cuda():
    assert measure_copy_bandwidth("cpu") is None and measure_gemm_rate("cpu") is None
    with pytest.raises(ValueError, match="dtype"):
        dtype_bytes(torch.int8)


@pytest.mark.gpu
def test_measurements_on_gpu_are_plausible():
    bw, rate = measure_copy_bandwidth("cuda", nbytes=1 << 28, iters=3), measure_gemm_rate("cuda", n=2048, iters=3)
    assert 1e10 < bw < 2e13 and 1e12 < rate < 5e15
