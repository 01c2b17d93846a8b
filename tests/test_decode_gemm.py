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
