"""CPU checks of the decode GEMM's wrapper logic (minillm/ops/decode_gemm.py): where covers() says it applies,
the mirror of the kernel's limits and legal configurations, and the grid (K splits, row warps) chosen per shape
and GPU size.
DECODE_SHAPES (every linear layer of the dense Qwen3 / Qwen2.5 models) is shared with the GPU test."""
import json
import re
from pathlib import Path

import pytest
import torch

from minillm.model.arch import ModelArchConfig
from minillm.ops import decode_gemm as dg
from minillm.ops.build import CUDA_DIR

# (hidden, heads, kv heads, head_dim, intermediate) of each model.
MODELS = {
    "qwen3-0.6b": (1024, 16, 8, 128, 3072),
    "qwen3-1.7b": (2048, 16, 8, 128, 6144),
    "qwen3-4b": (2560, 32, 8, 128, 9728),
    "qwen3-8b": (4096, 32, 8, 128, 12288),
    "qwen2.5-0.5b": (896, 14, 2, 64, 4864),
    "qwen2.5-1.5b": (1536, 12, 2, 128, 8960),
    "qwen2.5-3b": (2048, 16, 2, 128, 11008),
    "qwen2.5-7b": (3584, 28, 4, 128, 18944),
}


def layer_shapes(hidden: int, heads: int, kv: int, hd: int, inter: int) -> dict[str, tuple[int, int]]:
    """(N, K) of the four decode GEMMs of a layer: qkv, o_proj, gate_up, down."""
    return {"qkv": ((heads + 2 * kv) * hd, hidden), "o": (hidden, heads * hd), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter)}


DECODE_SHAPES = sorted({nk for m in MODELS.values() for nk in layer_shapes(*m).values()})


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen2.5-0.5b"])
def test_shape_table_matches_the_shipped_presets(preset):
    path = Path(__file__).resolve().parents[1] / "minillm" / "presets" / f"{preset}.json"
    a = ModelArchConfig.from_hf_dict(json.loads(path.read_text()))
    assert MODELS[preset] == (a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                              a.intermediate_size)


def test_shape_table_matches_known_layers():
    assert layer_shapes(*MODELS["qwen3-0.6b"]) == {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024),
                                                   "down": (1024, 3072)}
    assert layer_shapes(*MODELS["qwen2.5-0.5b"])["qkv"] == (1152, 896)
    assert len(DECODE_SHAPES) == 31  # Qwen3-1.7B and Qwen2.5-3B share o_proj


@pytest.mark.parametrize("n,k", DECODE_SHAPES)
def test_covers_every_qwen_decode_shape(n, k):
    for dtype in (torch.bfloat16, torch.float16):
        assert dg.covers(64, n, k, dtype, 9) is None


@pytest.mark.parametrize("args,words", [
    ((16, 4096, 1024, torch.bfloat16, 8), "sm_90"),
    ((16, 4096, 1024, torch.bfloat16, 10), "sm_90"),
    ((16, 4096, 1024, torch.float32, 9), "dtype"),
    ((65, 4096, 1024, torch.bfloat16, 9), "rows"),
    ((0, 4096, 1024, torch.bfloat16, 9), "rows"),
    ((16, 4160, 1024, torch.bfloat16, 9), "N must be"),
    ((16, 0, 1024, torch.bfloat16, 9), "N must be"),
    ((16, 4096, 1000, torch.bfloat16, 9), "K must be"),
    ((16, 4096, 1040, torch.bfloat16, 9), "K must be"),
])
def test_covers_names_the_reason(args, words):
    reason = dg.covers(*args)
    assert reason is not None and words in reason


def test_batches_and_configs_mirror_the_kernel():
    # batch_blocks(NT) / ctas_per_sm(NT) in decode_gemm.cu: NT = 4 (M 17-32) has 2 blocks per batch; NT = 8
    # (M 33-64) runs one CTA per SM.
    assert [dg.batch_blocks(m) for m in (1, 8, 9, 16, 17, 32, 33, 64)] == [4, 4, 4, 4, 2, 2, 4, 4]
    assert [dg.ctas_per_sm(m) for m in (1, 16, 17, 32, 33, 64)] == [2, 2, 2, 2, 1, 1]
    # decode_gemm_config_ok: every warp of every split gets at least one k32 block.
    assert dg.config_ok(1024, 4, 1)            # 4 x 8 warps along K = 32 blocks
    assert not dg.config_ok(1024, 5, 1)
    assert dg.config_ok(32, 1, 8) and not dg.config_ok(32, 2, 8) and not dg.config_ok(32, 1, 4)
    assert not dg.config_ok(4096, 0, 8) and not dg.config_ok(4096, 9, 8) and not dg.config_ok(4096, 1, 3)
    assert len(dg.configs(896)) == 8 + 8 + 7 + 3  # 28 blocks: row warps 8, 4, 2, 1


MODEL_SHAPES_06B = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]


@pytest.mark.parametrize("n,k", DECODE_SHAPES)
def test_chosen_config_is_legal_and_fills_the_gpu(n, k):
    for m in (1, 8, 16, 32, 64):
        s, rw = dg.choose_config(m, n, k, 132)
        assert dg.config_ok(k, s, rw) and n % (16 * rw) == 0
        ctas = n // (16 * rw) * s
        # Half the SMs at least get a CTA, unless the weight is tiny (under 2 MB) or no configuration reaches that.
        assert ctas >= 66 or n * k * 2 < 2 << 20 or not any(n // (16 * rw2) * s2 >= 66 for s2, rw2 in dg.configs(k))
        slots = dg.slots(m, s, 132)
        # Several waves only when their slots are at least 3/4 used (no thin tail wave).
        assert ctas <= slots or -(-ctas // slots) * slots * 3 <= ctas * 4, (m, s, rw, ctas)


def test_cluster_slots_match_the_measured_max_active_clusters():
    # ncu on the H200 (first kernel): 62 active clusters of 6 at 3 CTAs per SM; 30 of 4 at 1 CTA per SM.
    assert dg.slots(64, 4, 132) == 30 * 4
    assert dg.slots(1, 1, 132) == 264 and dg.slots(64, 1, 132) == 132
    assert dg.slots(1, 8, 132) == 30 * 8 and dg.slots(64, 8, 132) == 14 * 8


def test_model_prefers_row_warps_when_x_is_large():
    """At M = 64 every CTA's copy of x is 4x its weight bytes with 16-row CTAs: the model moves to wider CTAs."""
    assert dg.choose_config(64, 4096, 1024, 132)[1] >= 4
    assert dg.choose_config(1, 4096, 1024, 132)[0] == 1   # enough row blocks: no cluster at all


def test_model_charges_idle_sms_and_short_in_flight():
    n, k = 4096, 1024
    # 16 CTAs (8 row warps, no split) leave 116 SMs idle; 128 CTAs of 2 row warps do not.
    assert dg.model_us(1, n, k, 1, 8, 132) > dg.model_us(1, n, k, 1, 2, 132) + 1
    # A second wave costs its ramp.
    assert dg.model_us(64, n, k, 8, 2, 132) > dg.model_us(64, n, k, 1, 2, 132)


@pytest.mark.parametrize("n,k", MODEL_SHAPES_06B)
def test_model_is_near_the_floor_on_the_06b_shapes(n, k):
    floor = n * k * 2 / dg.HBM_BYTES_PER_US
    for m in (1, 16):
        assert dg.model_us(m, n, k, *dg.choose_config(m, n, k, 132), 132) <= floor + 1.5


def test_limits_match_the_cuda_header():
    header = (CUDA_DIR / "decode_gemm.h").read_text()
    consts = dict(re.findall(r"constexpr int (kDecodeGemm\w+) = (\d+);", header))
    assert {k: int(v) for k, v in consts.items()} == {"kDecodeGemmTileK": dg.TILE_K, "kDecodeGemmAlignN": dg.ALIGN_N,
                                                      "kDecodeGemmMaxRows": dg.MAX_ROWS,
                                                      "kDecodeGemmMaxSplits": dg.MAX_SPLITS,
                                                      "kDecodeGemmWarps": dg.WARPS}


def test_decode_gemm_refuses_cpu_tensors_by_name():
    with pytest.raises(ValueError, match="CUDA tensors"):
        dg.decode_gemm(torch.zeros(2, 64), torch.zeros(128, 64))


# ---- where the engine runs it: the measured-win table and linear()'s precedence -----------------------------------

SWEEP = Path(__file__).resolve().parents[1] / "results" / "gemm_sweep.jsonl"


def wins_in_sweep(lines: list[dict], commit: str) -> dict[tuple[int, int], int]:
    """(N, K) -> the most rows up to which the decode GEMM at `commit` beat cuBLAS (same run) and the skinny GEMM
    (its latest run) at every measured row count, alone and behind the norm; shapes with no win left out."""
    lines = [d for d in lines if {"impl", "n", "k", "m", "mode"} <= set(d)]
    skinny_commit = [d["commit"] for d in lines if d["impl"] == "skinny"][-1]
    us = {(d["impl"], d["n"], d["k"], d["m"], d["mode"]): d["us"] for d in lines
          if d["commit"] == (skinny_commit if d["impl"] == "skinny" else commit)}
    out = {}
    for n, k in sorted({(n, k) for impl, n, k, m, mode in us if impl == "decode"}):
        rows = 0
        for m in sorted({m for impl, n2, k2, m, mode in us if impl == "decode" and (n2, k2) == (n, k)}):
            won = all(us[("decode", n, k, m, mode)] < min(us.get((other, n, k, m, mode), float("inf"))
                                                          for other in ("cublas", "skinny"))
                      for mode in ("alone", "after_norm") if ("decode", n, k, m, mode) in us)
            if not won:
                break
            rows = m
        if rows:
            out[(n, k)] = rows
    return out


def test_measured_wins_is_what_the_sweep_measured():
    lines = [json.loads(line) for line in SWEEP.read_text().splitlines() if line.strip()]
    assert any(d.get("commit") == dg.MEASURED_AT and d.get("impl") == "decode" for d in lines)
    assert dg.MEASURED_WINS == wins_in_sweep(lines, dg.MEASURED_AT)


def test_wins_in_sweep_reads_wins_and_losses():
    def line(impl, m, mode, us, n=1024, k=2048, commit="c1"):
        return dict(impl=impl, n=n, k=k, m=m, mode=mode, us=us, commit=commit)

    lines = [line("skinny", m, mode, 5.0, commit="c0") for m in (1, 8, 16) for mode in ("alone", "after_norm")]
    lines += [line("cublas", m, mode, 6.0) for m in (1, 8, 16) for mode in ("alone", "after_norm")]
    lines += [line("decode", m, mode, 4.0 if m < 16 else 5.5) for m in (1, 8, 16) for mode in ("alone", "after_norm")]
    assert wins_in_sweep(lines, "c1") == {(1024, 2048): 8}
    lines.append(line("decode", 1, "after_norm", 5.1))   # a loss behind the norm at M=1: no win at all
    assert wins_in_sweep(lines, "c1") == {}


def test_layer_rows_asks_the_table_then_covers(monkeypatch):
    monkeypatch.setattr(dg, "MEASURED_WINS", {(1024, 2048): 16, (1000, 2048): 8})
    rows, why = dg.layer_rows(1024, 2048, False, torch.bfloat16, 9)
    assert rows == 16 and "up to 16 rows" in why
    assert dg.layer_rows(1024, 2048, True, torch.bfloat16, 9)[0] == 0            # a bias
    assert dg.layer_rows(1024, 3072, False, torch.bfloat16, 9) == (
        0, f"[1024, 3072] measured no faster than cuBLAS and the skinny GEMM (MEASURED_WINS, {dg.MEASURED_AT})")
    assert dg.layer_rows(1000, 2048, False, torch.bfloat16, 9) == (0, dg.covers(8, 1000, 2048, torch.bfloat16, 9))
    assert dg.layer_rows(1024, 2048, False, torch.float32, 9)[0] == 0
    rows, why = dg.layer_rows(1024, 2048, False, torch.bfloat16, 10)
    assert rows == 0 and "sm_90" in why


def test_coverage_declares_sm9x_bf16_fp16_graph_safe():
    assert dg.COVERAGE.graph_safe and set(dg.COVERAGE.dtypes) == {"bfloat16", "float16"}
    assert dg.COVERAGE.reason(dtype="float16", capability=(9, 0)) is None
    assert dg.COVERAGE.reason(dtype="bfloat16", capability=(10, 0)) is not None
    assert dg.COVERAGE.reason(dtype="float32", capability=(9, 0)) is not None


@pytest.fixture
def kernels(monkeypatch):
    """Stand-ins for the two GEMM kernels that record which ran (the dispatch logic runs on the CPU)."""
    from minillm.ops import gemm_ops

    ran = []
    monkeypatch.setattr(gemm_ops, "_num_sms", lambda index: 132)
    monkeypatch.setattr(dg, "run", lambda x, w, sms: ran.append("decode") or x @ w.T)
    monkeypatch.setattr(torch.ops, "minillm", type("Ops", (), {
        "skinny_gemm": staticmethod(lambda x, w, s: ran.append("skinny") or x @ w.T)}), raising=False)
    return ran


def test_linear_puts_decode_before_skinny_before_cublas(kernels):
    from minillm.ops.gemm_ops import MAX_ROWS, linear

    w = torch.randn(128, 64)
    for m, skinny, rows, want in [(1, True, 16, "decode"), (16, True, 16, "decode"), (16, True, 8, "skinny"),
                                  (MAX_ROWS + 1, True, MAX_ROWS + 1, "decode"), (MAX_ROWS + 1, True, 8, "cublas"),
                                  (4, False, 0, "cublas"), (4, True, 0, "skinny"), (4, False, 8, "decode")]:
        kernels.clear()
        x = torch.randn(m, 64)
        torch.testing.assert_close(linear(x, w, skinny=skinny, decode_rows=rows), x @ w.T)
        assert (kernels or ["cublas"]) == [want], (m, skinny, rows)


def test_model_layers_take_the_plans_row_counts():
    from minillm.attention.torch_backend import TorchAttentionBackend
    from minillm.model.layers import Linear
    from minillm.model.qwen3 import QwenForCausalLM
    from minillm.ops.choice import ModelKernels

    arch = ModelArchConfig.from_hf_dict(dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32,
                                             intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                             num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                                             rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True))
    on = ModelKernels(cuda=True, decode_gemm=frozenset({("o_proj", 16), ("down_proj", 8)}))
    model = QwenForCausalLM(arch, TorchAttentionBackend(), dtype=torch.float32, kernels=on)
    rows = {name.rsplit(".", 1)[1]: m.decode_rows for name, m in model.named_modules() if isinstance(m, Linear)}
    assert rows == {"qkv_proj": 0, "o_proj": 16, "gate_up_proj": 0, "down_proj": 8}
    with model.torch_path():   # the reference path runs no kernel of ours
        assert not any(m.decode_rows for m in model.modules() if isinstance(m, Linear))
    assert sum(m.decode_rows for m in model.modules() if isinstance(m, Linear)) == 2 * (16 + 8)
