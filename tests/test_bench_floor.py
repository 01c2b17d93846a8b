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


def _kv_token_reads(prompts, max_tokens):
    """Brute force: the k-th output token of a request attends over its prompt and the k outputs before it."""
    return sum(p + k for p, m in zip(prompts, max_tokens) for k in range(m))


def _steps_simulated(max_tokens, max_num_seqs):
    """Decode steps of a batch that admits in order into free slots (one token per running request a step)."""
    waiting, running, steps = list(max_tokens), [], 0
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            running.append(waiting.pop(0))
        running = [m - 1 for m in running if m > 1]
        steps += 1
    return steps


@pytest.mark.parametrize("prompts,max_tokens,seqs", [([10, 10, 10], [5, 5, 5], 1), ([3, 70, 9, 1], [8, 2, 30, 4], 2),
                                                    ([100] * 6, [7] * 6, 6)])
def test_kv_bytes_and_steps_against_a_brute_force_count(prompts, max_tokens, seqs):
    work = workload_work(QWEN3_06B, prompts, max_tokens, 2, max_num_seqs=seqs)
    assert work.kv_bytes == _kv_token_reads(prompts, max_tokens) * 28 * 8 * 128 * 2 * 2
    # the floor's step count is a lower bound: no schedule takes fewer steps
    assert work.num_steps <= _steps_simulated(max_tokens, seqs)
    assert work.num_steps >= max(max_tokens)


def test_floor_record_fraction_and_nulls():
    work = _reference_work()
    rec = floor_record(work, DeviceRates(4.23e12, 760e12, 1.0), wall_s=7.5)
    assert rec["fraction_of_floor"] == pytest.approx(3.75 / 7.5, abs=0.002)   # the documented floor, half of it
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
