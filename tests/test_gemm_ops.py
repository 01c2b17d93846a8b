"""CPU checks of the skinny GEMM's split choice (the kernel itself: tests/test_gemm_gpu.py)."""

from minillm.ops import gemm_ops


def test_splits_fill_one_wave_and_divide_k():
    # Qwen3-0.6B decode shapes on 132 SMs
    assert gemm_ops.gemm_splits(128, 4096, 1024, 132) == 4    # 32 tiles x 4
    assert gemm_ops.gemm_splits(128, 6144, 1024, 132) == 2    # 48 tiles x 2
    assert gemm_ops.gemm_splits(128, 1024, 2048, 132) == 8    # 8 tiles x 8
    assert gemm_ops.gemm_splits(256, 1024, 3072, 132) == 8    # 16 tiles x 8
    assert gemm_ops.gemm_splits(16, 6144, 1024, 132) == 4     # small tiles: two CTAs per SM
    assert gemm_ops.gemm_splits(256, 6144, 1024, 132) == 1    # 96 tiles: no room to split
    assert gemm_ops.gemm_splits(8, 1024, 192, 132) == 1       # K = 3 x 64 allows no power-of-two split
    for m in (1, 17, 100, 256):
        for n, k in ((4096, 1024), (1024, 2048), (1024, 3072)):
            s = gemm_ops.gemm_splits(m, n, k, 132)
            assert k % (s * gemm_ops.TILE_K) == 0
