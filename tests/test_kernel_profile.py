"""minillm/bench/kernel_profile.py: kernel categories, the busy-time union, device-only accounting; and
scripts/profile_bench.py end to end on the CPU (tiny demo model, a few short requests)."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from minillm.bench.kernel_profile import (Span, category, device_spans, idle_gaps, merged_runs, summarize,
                                          summarize_profile, union_length)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_bench.py"


@pytest.mark.parametrize("name, want", [
    ("void minillm::(anonymous namespace)::paged_decode_kernel<__nv_bfloat16, 128, 16, 2>(__nv_bfloat16*, int)",
     "decode attention"),
    ("void minillm::(anonymous namespace)::decode_reduce_kernel<__nv_bfloat16, 128>(float const*)", "decode attention"),
    ("void minillm::(anonymous namespace)::paged_prefill_kernel<__nv_bfloat16, 128, 16>(...)", "prefill attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4> >(...)", "prefill attention"),
    ("aten::scaled_dot_product_attention", "prefill attention"),
    ("void minillm::(anonymous namespace)::kv_write_kernel<__nv_bfloat16>(...)", "kv write"),
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(...)", "gemm"),
    ("aten::addmm", "gemm"),
    ("void minillm::(anonymous namespace)::rms_norm_kernel<__nv_bfloat16>(...)", "norm/rope/act"),
    ("void minillm::(anonymous namespace)::qk_norm_rope_kernel<__nv_bfloat16, 128>(...)", "norm/rope/act"),
    ("void minillm::(anonymous namespace)::silu_and_mul_kernel<__nv_bfloat16>(...)", "norm/rope/act"),
    ("void minillm::(anonymous namespace)::exponential_race_kernel<__nv_bfloat16>(...)", "sampler"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>(...)", "sampler"),
    ("Memcpy HtoD (Pinned -> Device)", "copy"),
    ("Memset (Device)", "copy"),
    ("void at::native::index_elementwise_kernel<128, 4>(long, ...)", "copy"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>", "copy"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float> > >", "other"),
])
def test_category(name, want):
    assert category(name) == want


def test_union_length_merges_overlaps():
    # [0,2] and [1,3] merge to [0,3]; [5,6] swallows [5.5,5.7]; [6,7] touches [5,6]; [10,10] is empty.
    intervals = [(5.5, 5.7), (1, 3), (0, 2), (6, 7), (5, 6), (10, 10)]
    assert union_length(intervals) == pytest.approx(3 + 2 + 0)
    assert union_length([]) == 0.0
    assert union_length([(4, 9), (5, 6), (6, 8)]) == pytest.approx(5)   # nested entirely in the first


def _spans():
    # us: a GEMM on one stream overlapping a memcpy on another, a gap, then two decode kernels back to back.
    return [Span("nvjet_sm90_tst_64x8", 0, 100, 100), Span("Memcpy HtoD (Pinned -> Device)", 50, 150, 100),
            Span("paged_decode_kernel<bf16>", 400, 500, 100), Span("paged_decode_kernel<bf16>", 500, 600, 100)]


def test_idle_gaps_by_slice_and_long_gaps():
    # busy runs [0, 10], [12, 20] (two overlapping kernels), [100, 110]: gaps of 2 us (at 10) and 80 us (at 20)
    intervals = [(0, 10), (12, 15), (14, 20), (100, 110)]
    assert merged_runs(intervals) == [(0, 10), (12, 20), (100, 110)]
    g = idle_gaps(intervals, parts=2, long_us=50)
    assert g["long_gaps"] == 1 and g["long_gap_ms"] == pytest.approx(0.080)
    # the trace spans 0..110 us: slice 0 is [0, 55), where both gaps start
    assert g["idle_by_slice_ms"] == [pytest.approx(0.082), 0.0]
    # the 2 us gap sits on the edge of the first bucket, so it counts in the next one up
    assert g["idle_by_gap_size_ms"] == {"<2us": 0.0, "<5us": pytest.approx(0.002), "<20us": 0.0, "<50us": 0.0,
                                        ">=50us": pytest.approx(0.080)}
    assert idle_gaps([(0, 5)], parts=3)["idle_by_slice_ms"] == [0.0, 0.0, 0.0]


def test_summarize_busy_idle_and_categories():
    s = summarize(_spans(), steps=2, top=2)
    assert s["busy_ms"] == pytest.approx(0.150 + 0.200)      # [0,150] and [400,600]
    assert s["kernel_sum_ms"] == pytest.approx(0.400)        # the sum counts the overlap twice
    assert s["span_ms"] == pytest.approx(0.600) and s["window_ms"] == pytest.approx(0.600)
    assert s["idle_ms"] == pytest.approx(0.250)
    assert s["by_category_ms"] == pytest.approx({"decode attention": 0.2, "gemm": 0.1, "copy": 0.1})
    assert list(s["by_category_ms"])[0] == "decode attention"
    top = s["top_kernels"]
    assert len(top) == 2 and top[0]["name"] == "paged_decode_kernel<bf16>" and top[0]["calls"] == 2
    assert top[0]["total_ms"] == pytest.approx(0.2) and top[0]["mean_us"] == pytest.approx(100)
    assert s["per_step"]["busy_ms"] == pytest.approx(0.175)
    assert s["per_step"]["by_category_ms"]["decode attention"] == pytest.approx(0.1)
    walled = summarize(_spans(), wall_ms=1.0)
    assert walled["idle_ms"] == pytest.approx(0.65) and walled["busy_fraction"] == pytest.approx(0.35)
    assert walled["per_step"] is None


def _event(name, device, start, end, activity, annotation=False):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                           activity_type=activity, is_user_annotation=annotation, self_cpu_time_total=end - start)


def _old_torch_event(name, device, start, end, annotation=False):
    """torch 2.11's FunctionEvent: no activity_type attribute."""
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                           is_user_annotation=annotation, self_cpu_time_total=end - start)


def test_only_device_work_is_counted():
    """The CPU op that launched a GEMM and a GPU-side annotation range both cover the kernel's time; counting
    them was the double counting of the old key_averages() sum."""
    events = [_event("aten::linear", DeviceType.CPU, 0, 20, "cpu_op"),
              _event("aten::mm", DeviceType.CPU, 2, 18, "cpu_op"),
              _event("decode_step", DeviceType.CUDA, 0, 200, "gpu_user_annotation"),
              _event("nvjet_sm90_tst_64x8", DeviceType.CUDA, 30, 80, "kernel"),
              _event("Memset (Device)", DeviceType.CUDA, 80, 90, "gpu_memset"),
              _event("Memcpy DtoH (Device -> Pinned)", DeviceType.CUDA, 100, 110, "gpu_memcpy")]
    prof = SimpleNamespace(events=lambda: events)
    assert [s.name for s in device_spans(prof)] == ["nvjet_sm90_tst_64x8", "Memset (Device)",
                                                   "Memcpy DtoH (Device -> Pinned)"]
    s = summarize_profile(prof)
    assert s["source"] == "device kernels"
    assert s["by_category_ms"] == pytest.approx({"gemm": 0.050, "copy": 0.020})
    assert s["busy_ms"] == pytest.approx(0.070) and s["span_ms"] == pytest.approx(0.080)


def test_only_device_work_is_counted_without_activity_type():
    events = [_old_torch_event("aten::mm", DeviceType.CPU, 2, 18),
              _old_torch_event("step", DeviceType.CUDA, 0, 5000, annotation=True),
              _old_torch_event("nvjet_sm90_tst_64x8", DeviceType.CUDA, 30, 80)]
    s = summarize_profile(SimpleNamespace(events=lambda: events))
    assert s["num_events"] == 1 and s["by_category_ms"] == pytest.approx({"gemm": 0.050})


def test_cpu_fallback_charges_self_time():
    ev = [_event("aten::linear", DeviceType.CPU, 0, 20, "cpu_op"), _event("aten::mm", DeviceType.CPU, 2, 18, "cpu_op"),
          _event("Optimizer.step", DeviceType.CPU, 30, 40, "user_annotation")]
    ev[0].self_cpu_time_total = 4   # 20 us minus its child's 16
    s = summarize_profile(SimpleNamespace(events=lambda: ev))
    assert s["source"] == "cpu aten ops" and s["num_events"] == 2
    assert s["kernel_sum_ms"] == pytest.approx(0.020) and s["busy_ms"] == pytest.approx(0.020)


WORKLOAD = "kind: offline\nnum_requests: 8\nprompt_len: [8, 40]\noutput_len: [3, 12]\nmax_token_id: 4000\n" \
           "max_model_len: 128\n"


def test_profile_bench_smoke(tmp_path):
    wl, out = tmp_path / "wl.yaml", tmp_path / "pb.json"
    wl.write_text(WORKLOAD)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--workload", str(wl), "--num-requests",
                           "6", "--set", "runtime.device=cpu", "--set", "scheduler.max_num_batched_tokens=64",
                           "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for key in ("wall_a_s", "wall_b_s", "output_tok_s", "floor", "step_profile", "kernels", "decode_attention",
                "config", "workload"):
        assert key in res
    assert res["wall_a_s"] > 0 and res["wall_b_s"] > 0
    assert res["config"]["scheduler"]["max_num_batched_tokens"] == 64 and res["config"]["model"]["model"] is None
    assert res["workload"]["num_requests"] == 6
    assert res["output_tok_s"] == pytest.approx(res["workload"]["output_tokens"] / res["wall_a_s"])
    assert res["floor"]["kv_bytes"] > 0 and res["floor"]["fraction_of_floor"] is None   # no GPU rates on a CPU
    assert res["step_profile"]["steps"] > 0 and res["step_profile"]["ms_per_step"]["forward"] > 0
    k = res["kernels"]
    assert k["source"] == "cpu aten ops" and k["steps"] > 0 and k["num_events"] > 0
    assert 0 < k["busy_ms"] <= k["window_ms"] and k["window_ms"] == pytest.approx(1e3 * res["wall_b_s"])
    assert sum(k["by_category_ms"].values()) == pytest.approx(k["kernel_sum_ms"])
    assert k["by_category_ms"]["gemm"] > 0 and k["top_kernels"][0]["calls"] > 0
    assert len(k["idle_gaps"]["idle_by_slice_ms"]) == 10 and min(k["idle_gaps"]["idle_by_slice_ms"]) >= 0
    assert res["decode_attention"]["kv_bytes"] == res["floor"]["kv_bytes"]
    assert "wall A" in proc.stdout and "busy" in proc.stdout
