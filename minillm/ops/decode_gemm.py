"""The decode GEMM (minillm/cuda/decode_gemm.cu): y = x W^T for decode batches (M <= 256) on Hopper.

It streams the weight through a ring of bulk copies that start before the programmatic-dependent-launch wait, so
the weight bytes move while the kernel before it finishes; cuBLAS takes no part in PDL. Where it applies is said in
one place, covers(); the C++ binding's checks state the same limits. tile_m / tile_n / smem_bytes mirror the
kernel's Tiling<MT> so that choose_splits can size the grid to the GPU without a device query of its own.
F.linear is the reference it is tested against (tests/test_decode_gemm_gpu.py).
"""
from __future__ import annotations

from functools import lru_cache

import torch

TILE_K = 64            # K per ring stage (kDecodeGemmTileK)
ALIGN_N = 128          # N must be a multiple (kDecodeGemmAlignN: the widest weight-row tile)
MAX_ROWS = 256         # kDecodeGemmMaxRows
MAX_SPLITS = 8         # kDecodeGemmMaxSplits: the portable cluster size
SM_SMEM = 228 * 1024   # shared memory per Hopper SM; each CTA also reserves 1 KB
DTYPES = (torch.bfloat16, torch.float16)


def tile_m(m: int) -> int:
    """Rows of x per CTA (the kernel's MT): the smallest of 16/32/64/128 holding m, 128 beyond."""
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


def tile_n(mt: int) -> int:
    """Weight rows per CTA (Tiling<MT>::BN)."""
    return 128 if mt >= 64 else 64


def smem_bytes(mt: int) -> int:
    """Dynamic shared memory of one CTA (Tiling<MT>::SMEM): barriers + the ring, or the partial tile if larger."""
    stages = 5 if mt >= 128 else 6
    ring = stages * (tile_n(mt) + mt) * (TILE_K + 8) * 2
    return 128 + max(ring, mt * (tile_n(mt) + 4) * 4)


def ctas_per_sm(mt: int) -> int:
    return SM_SMEM // (smem_bytes(mt) + 1024)


def covers(m_max: int, n: int, k: int, dtype: torch.dtype, sm_major: int) -> str | None:
    """Why the decode GEMM cannot compute [m, k] x [n, k]^T for every m <= m_max, or None when it can.
    (The tensors must also be contiguous and 16-byte aligned, which decode_gemm() arranges for x.)"""
    if sm_major != 9:
        # The body is compiled for sm_90a only: the sm_80 PTX that newer GPUs JIT has none of it.
        return f"needs an sm_90 GPU (Hopper), this one is sm_{sm_major}x"
    if dtype not in DTYPES:
        return f"dtype must be bfloat16 or float16, got {dtype}"
    if not 1 <= m_max <= MAX_ROWS:
        return f"rows must be in [1, {MAX_ROWS}], got {m_max}"
    if n <= 0 or n % ALIGN_N:
        return f"N must be a positive multiple of {ALIGN_N}, got {n}"
    if k <= 0 or k % TILE_K:
        return f"K must be a positive multiple of {TILE_K}, got {k}"
    return None


WAVE_COST_K_TILES = 2   # a wave's fixed cost (first-load latency, cluster reduction) in k-tiles of streaming


def choose_splits(m: int, n: int, k: int, num_sms: int) -> int:
    """K splits (cluster size) for an [m, k] x [n, k]^T product: the fewest that minimise the modelled time,
    waves x (k-tiles of the longest range + WAVE_COST_K_TILES), counting as many resident CTAs per SM as shared
    memory allows. A model to be checked against scripts/gemm_sweep.py's best split, not a measurement."""
    mt = tile_m(m)
    tiles = (n // tile_n(mt)) * -(-m // mt)
    slots = num_sms * ctas_per_sm(mt)
    k_tiles = k // TILE_K
    best, best_cost = 1, None
    for s in range(1, min(MAX_SPLITS, k_tiles) + 1):
        cost = -(-tiles * s // slots) * (-(-k_tiles // s) + WAVE_COST_K_TILES)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


@lru_cache(maxsize=8)
def _device(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.major, props.multi_processor_count


def decode_gemm(x: torch.Tensor, w: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """y = x w^T on the decode GEMM kernel (splits=None: choose_splits). Raises ValueError naming the reason
    when covers() refuses the shape."""
    if not (x.is_cuda and w.is_cuda) or x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"decode_gemm needs CUDA tensors x [M, K] and w [N, K], got {tuple(x.shape)} on "
                         f"{x.device} and {tuple(w.shape)} on {w.device}")
    major, sms = _device(x.device.index or 0)
    (m, k), n = x.shape, w.shape[0]
    reason = covers(m, n, k, x.dtype, major)
    if reason is not None:
        raise ValueError(f"decode_gemm does not apply: {reason}")
    return torch.ops.minillm.decode_gemm(x, w, choose_splits(m, n, k, sms) if splits is None else splits)
