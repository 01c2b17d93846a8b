"""Linear layers: the skinny GEMM kernel (cuda/skinny_gemm.cu) for decode-sized batches, cuBLAS otherwise.

At decode batch sizes a [M, K] x [K, N] product has few output tiles, and cuBLAS spends 5.5-8 us on weights that
HBM delivers in 1-3 us; the kernel splits K over a thread-block cluster instead. Measured on the H200 (b80198d,
results/gemm_sweep.jsonl) it only wins for a handful of rows on narrow outputs: o_proj of Qwen3-0.6B at M=1
4.9 us vs cuBLAS's 12.6, at M=8-16 ~0.6 us less on o_proj and down_proj; from 32 rows on, and on the wide qkv
and gate_up outputs, it is slower (M=128 qkv: 17.5 vs 5.5 us; docs/fused-kernels.md says why). So it runs only there (MAX_ROWS, MAX_N): single-
stream and small-batch decode. It needs clusters (sm_90), no bias, N a multiple of 128 and K a multiple of 64 x
splits (COVERAGE, shape_reason): the engine's plan (minillm/runner/plan.py) checks that once per layer, and every
other layer goes to F.linear, which is also the reference the kernel is tested against. kernels.skinny_gemm=false
turns the kernel off (A/B timings).

The decode GEMM (minillm/ops/decode_gemm.py) goes first where the plan put a layer on it (its measured-win table and
covers()), so linear() picks decode GEMM > skinny GEMM > cuBLAS from the row count alone.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from minillm.ops import decode_gemm
from minillm.ops.coverage import KernelCoverage

MAX_ROWS = 16            # measured faster than cuBLAS up to here (see above)
MAX_N = 2048             # ... and on outputs this narrow (16 tiles); wider ones have tiles enough for cuBLAS
TILE_N, TILE_K = 128, 64  # the kernel's output-column tile and K stage (cuda/gemm.h)
SPLITS = (8, 4, 2, 1)    # K splits = CTAs of one cluster (8 is the portable cluster size)


# sm_90: the K split runs over a thread-block cluster (skinny_gemm.cu); no float32 variant (fused_bindings.cpp).
# sm_9x only: the body is guarded by __CUDA_ARCH__ >= 900, so the sm_80 PTX a newer GPU JITs would write nothing.
COVERAGE = KernelCoverage("skinny_gemm", dtypes=("bfloat16", "float16"), min_capability=(9, 0), max_major=9,
                          graph_safe=True)


def shape_reason(n: int, k: int, bias: bool) -> str | None:
    """Why the kernel does not take a [*, k] x [n, k]^T layer, or None: the shape limits beyond COVERAGE, asked
    once per linear layer when the engine's plan is made (the row count is the only per-call question)."""
    if bias:
        return "the layer has a bias (the kernel adds none)"
    if n > MAX_N:
        return f"N={n} > {MAX_N}: wide outputs have tiles enough for cuBLAS"
    if n % TILE_N or k % TILE_K:
        return f"N={n}, K={k}: N must be a multiple of {TILE_N} and K of {TILE_K}"
    return None


@lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def gemm_splits(m: int, n: int, k: int, num_sms: int) -> int:
    """K splits for an [m, k] x [n, k]^T product: the most that keep the grid within one wave of CTAs (one per
    SM for 64- and 128-row tiles, two for the smaller tiles, whose shared memory lets two share an SM)."""
    m_tile = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    slots = num_sms * (2 if m_tile <= 32 else 1)
    tiles = (n // TILE_N) * -(-m // m_tile)
    for s in SPLITS:
        if k % (s * TILE_K) == 0 and tiles * s <= slots:
            return s
    return 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           skinny: bool = False, decode_rows: int = 0) -> torch.Tensor:
    """y = x W^T (+ b). The engine's plan decided per layer (dtype, shape and GPU covered): decode_rows > 0 puts
    products of up to that many rows on the decode GEMM (the layer has no bias then); skinny=True puts products of
    up to MAX_ROWS rows on the skinny GEMM; anything else runs cuBLAS."""
    m = x.shape[0]
    if 0 < m <= decode_rows:
        return decode_gemm.run(x, weight, _num_sms(x.device.index or 0))
    if skinny and 0 < m <= MAX_ROWS:
        n, k = weight.shape
        return torch.ops.minillm.skinny_gemm(x, weight, gemm_splits(m, n, k, _num_sms(x.device.index or 0)))
    return F.linear(x, weight, bias)
