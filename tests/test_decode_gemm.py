"""CPU checks of the decode GEMM's wrapper logic (minillm/ops/decode_gemm.py): where covers() says it applies,
the tile and shared-memory mirror of the kernel's Tiling<MT>, and the K split chosen per shape and GPU size.
DECODE_SHAPES (every linear layer of the dense Qwen3 / Qwen2.5 models) is shared with the GPU test."""
import json
import re
from pathlib import Path

import pytest
import torch

from minillm.model.arch import ModelArchConfig
from minillm.ops import decode_gemm as dg

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
        assert dg.covers(256, n, k, dtype, 9) is None


@pytest.mark.parametrize("args,words", [
    ((16, 4096, 1024, torch.bfloat16, 8), "sm_90"),
    ((16, 4096, 1024, torch.bfloat16, 10), "sm_90"),
    ((16, 4096, 1024, torch.float32, 9), "dtype"),
    ((257, 4096, 1024, torch.bfloat16, 9), "rows"),
    ((0, 4096, 1024, torch.bfloat16, 9), "rows"),
    ((16, 4160, 1024, torch.bfloat16, 9), "N must be"),
    ((16, 0, 1024, torch.bfloat16, 9), "N must be"),
    ((16, 4096, 1000, torch.bfloat16, 9), "K must be"),
])
def test_covers_names_the_reason(args, words):
    reason = dg.covers(*args)
    assert reason is not None and words in reason


def test_tiles_mirror_the_kernel():
    assert [dg.tile_m(m) for m in (1, 16, 17, 32, 33, 64, 65, 128, 129, 256)] == [16, 16, 32, 32, 64, 64, 128, 128,
                                                                                128, 128]
    assert [dg.tile_n(mt) for mt in (16, 32, 64, 128)] == [64, 64, 128, 128]
    # Tiling<MT>::SMEM: 128 bytes of barriers + stages x (BN + MT) rows x 144 bytes.
    assert [dg.smem_bytes(mt) for mt in (16, 32, 64, 128)] == [69248, 83072, 166016, 184448]
    assert all(dg.smem_bytes(mt) <= 227 * 1024 for mt in (16, 32, 64, 128))
    assert [dg.ctas_per_sm(mt) for mt in (16, 32, 64, 128)] == [3, 2, 1, 1]


@pytest.mark.parametrize("m,n,k,want", [
    (1, 4096, 1024, 6),    # 64 tiles x 6 = 384 of 396 slots, 3 of 16 k-tiles each (8 would take two waves)
    (1, 1024, 2048, 8),    # 16 tiles: the whole cluster, 4 of 32 k-tiles each
    (64, 6144, 1024, 2),   # 48 tiles of 128 rows, one CTA per SM: 96 <= 132; 4 splits would take two waves
    (256, 4096, 1024, 2),  # 32 tiles x 2 row blocks = 64; x2 = 128 <= 132
    (1, 24576, 4096, 1),   # 384 tiles of 64 rows: one wave of 396 already
])
def test_choose_splits(m, n, k, want):
    assert dg.choose_splits(m, n, k, 132) == want


@pytest.mark.parametrize("n,k", DECODE_SHAPES)
def test_splits_are_legal_and_fill_the_gpu(n, k):
    k_tiles = k // dg.TILE_K
    for m in (1, 8, 16, 32, 64, 128, 256):
        s = dg.choose_splits(m, n, k, 132)
        assert 1 <= s <= min(dg.MAX_SPLITS, k_tiles)
        mt = dg.tile_m(m)
        ctas = (n // dg.tile_n(mt)) * -(-m // mt) * s
        # Either the grid fills at least half a wave, or its longest k range is already as short as the largest
        # legal split would make it.
        assert ctas * 2 >= 132 * dg.ctas_per_sm(mt) or -(-k_tiles // s) == -(-k_tiles // min(dg.MAX_SPLITS, k_tiles))


def test_limits_match_the_cuda_header():
    header = (Path(__file__).resolve().parents[1] / "minillm" / "cuda" / "decode_gemm.h").read_text()
    consts = dict(re.findall(r"constexpr int (kDecodeGemm\w+) = (\d+);", header))
    assert {k: int(v) for k, v in consts.items()} == {"kDecodeGemmTileK": dg.TILE_K, "kDecodeGemmAlignN": dg.ALIGN_N,
                                                      "kDecodeGemmMaxRows": dg.MAX_ROWS,
                                                      "kDecodeGemmMaxSplits": dg.MAX_SPLITS}


def test_decode_gemm_refuses_cpu_tensors_by_name():
    with pytest.raises(ValueError, match="CUDA tensors"):
        dg.decode_gemm(torch.zeros(2, 64), torch.zeros(128, 64))
