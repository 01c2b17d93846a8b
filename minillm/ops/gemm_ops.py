"""Linear layers: the skinny GEMM kernel (cuda/skinny_gemm.cu) for decode-sized batches, cuBLAS otherwise.

At decode batch sizes a [M, K] x [K, N] product has few output tiles, and cuBLAS spends 5.5-8 us on weights that
HBM delivers in 1-3 us; the kernel splits K over a thread-block cluster instead. Measured on the H200 (b80198d,
results/gemm_sweep.jsonl) it only wins for a handful of rows on narrow outputs: o_proj of Qwen3-0.6B at M=1
4.9 us vs cuBLAS's 12.6, at M=8-16 ~0.6 us less on o_proj and down_proj; from 32 rows on, and on the wide qkv
and gate_up outputs, it is slower (M=128 qkv: 17.5 vs 5.5 us; docs/fused-kernels.md says why). So it runs only there (MAX_ROWS, MAX_N): single-
stream and small-batch decode. It needs clusters (sm_90), no bias, N a multiple of 128 and K a multiple of 64 x
splits; anything else, and every CPU tensor, goes to F.linear, which is also the reference the kernel is tested
against. kernels.skinny_gemm=false turns the kernel off (A/B timings).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

MAX_ROWS = 16            # measured faster than cuBLAS up to here (see above)
MAX_N = 2048             # ... and on outputs this narrow (16 tiles); wider ones have tiles enough for cuBLAS
TILE_N, TILE_K = 128, 64  # the kernel's output-column tile and K stage (cuda/gemm.h)
SPLITS = (8, 4, 2, 1)    # K splits = CTAs of one cluster (8 is the portable cluster size)


@lru_cache(maxsize=8)
def _device_info(index: int) -> tuple[bool, int]:
    props = torch.cuda.get_device_properties(index)
    return props.major >= 9, props.multi_processor_count


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


def skinny_gemm_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """True when linear(x, weight, bias, skinny=True) runs the skinny GEMM kernel."""
    if bias is not None or x.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS or not x.is_cuda:
        return False
    n, k = weight.shape
    if n > MAX_N:
        return False
    sm90, _ = _device_info(x.device.index or 0)
    return (sm90 and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and n % TILE_N == 0 and k % TILE_K == 0 and x.shape[1] == k)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           skinny: bool = False) -> torch.Tensor:
    """y = x W^T (+ b); skinny=True (the engine's KernelChoice) lets decode-sized products take the kernel."""
    if skinny and skinny_gemm_applies(x, weight, bias):
        n, k = weight.shape
        splits = gemm_splits(x.shape[0], n, k, _device_info(x.device.index or 0)[1])
        return torch.ops.minillm.skinny_gemm(x, weight, splits)
    return F.linear(x, weight, bias)
