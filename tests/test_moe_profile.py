"""Profiling a Qwen3-MoE decode step: the MoE kernels have their own categories in minillm/bench/kernel_profile.py
(fused routing; fused expert GEMMs or torch._grouped_mm), and scripts/profile_decode.py runs a MoE checkpoint
(tiny, CPU, dummy weights) with its expert GEMMs under "moe experts"."""
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from minillm.bench.kernel_profile import category
from tiny_models import make_tiny_moe_checkpoint

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_decode.py"
GROUPED_MM_SM90 = ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm90<cutlass::gemm::kernel::"
                   "GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int>>, ...>>>(...)")


@pytest.mark.parametrize("name, want", [
    ("void minillm::(anonymous namespace)::moe_topk_kernel<4>(float const*, long, int, int, int, bool, ...)",
     "moe routing"),
    ("void minillm::(anonymous namespace)::moe_group_kernel(int const*, int, int, int, int*, ...)", "moe routing"),
    ("void minillm::(anonymous namespace)::moe_gate_up_kernel<__nv_bfloat16, 4, 2>(__nv_bfloat16 const*, ...)",
     "moe experts"),
    ("void minillm::(anonymous namespace)::moe_down_kernel<__nv_bfloat16, 4, 2>(__nv_bfloat16 const*, ...)",
     "moe experts"),
    ("void minillm::(anonymous namespace)::moe_combine_kernel<__nv_bfloat16>(float const*, int, int, ...)",
     "moe experts"),
    ("void minillm::(anonymous namespace)::moe_route_gemv_kernel<__nv_bfloat16, 4>(__nv_bfloat16 const*, ...)",
     "moe routing"),
    ("void minillm::(anonymous namespace)::moe_down_combine_kernel<__nv_bfloat16>(__nv_bfloat16 const*, ...)",
     "moe experts"),
    (GROUPED_MM_SM90, "moe experts"),
    ("aten::_grouped_mm", "moe experts"),
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "gemm"),   # a dense GEMM stays a GEMM
])
def test_moe_kernel_categories(name, want):
    assert category(name) == want


def test_profile_decode_runs_a_moe_checkpoint(tmp_path):
    spec = importlib.util.spec_from_file_location("profile_decode", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    ckpt = make_tiny_moe_checkpoint(tmp_path / "moe", experts=8, top_k=2)
    res = script.run(SimpleNamespace(model=str(ckpt), batch=2, context=24, steps=3, async_scheduling=False))
    assert res["kernels"]["source"] == "cpu aten ops" and res["device"] == "cpu"
    assert res["by_category_ms"]["moe experts"] > 0
    assert any(k["name"] == "aten::_grouped_mm" and k["category"] == "moe experts"
               for k in res["kernels"]["top_kernels"])
