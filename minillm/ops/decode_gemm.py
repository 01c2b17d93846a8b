"""The decode GEMM (cuda/decode_gemm.cu): y = x W^T for decode batches (M <= 64) on Hopper.

It loads the weight straight into mma.sync registers, the first batches before the programmatic-dependent-launch
wait, so weight bytes move while the kernel before it finishes; cuBLAS takes no part in PDL. Where it applies is
said in one place, covers(); the C++ binding's checks state the same limits. choose_config picks the grid (K
splits over a cluster, row warps per CTA) from a model of the kernel (constants below mirror decode_gemm.cu).
F.linear is the reference it is tested against (tests/test_decode_gemm_gpu.py).
"""
from __future__ import annotations

from functools import lru_cache

import torch

from minillm.ops.coverage import KernelCoverage

TILE_K = 32            # K per register block (kDecodeGemmTileK)
ALIGN_N = 128          # N must be a multiple (kDecodeGemmAlignN: the widest CTA, 8 warps x 16 rows)
MAX_ROWS = 64          # kDecodeGemmMaxRows: larger M stays on cuBLAS
MAX_SPLITS = 8         # kDecodeGemmMaxSplits: the portable cluster size
WARPS = 8              # kDecodeGemmWarps: warps per CTA, row_warps x (8 / row_warps) along K
ROW_WARPS = (8, 4, 2, 1)
DTYPES = (torch.bfloat16, torch.float16)

# sm_90 only: the body is compiled for sm_90a, and the sm_80 PTX that newer GPUs JIT has none of it. Graph-safe:
# no host sync, and the only allocation (the output, or a contiguous copy of a misaligned x) has a fixed size.
COVERAGE = KernelCoverage("decode_gemm", dtypes=("bfloat16", "float16"), min_capability=(9, 0), max_major=9,
                          graph_safe=True)

# (N, K) -> the most rows up to which the kernel measured faster than both cuBLAS and the skinny GEMM, alone and
# behind a PDL-launched RMSNorm (how it runs in a step): H200, decode GEMM at commit 5671c98 against the skinny
# GEMM's latest lines (4c54560) in results/gemm_sweep.jsonl, us per call in CUDA graphs (docs/kernels.md). Empty:
# it beat cuBLAS on Qwen3-0.6B's narrow o_proj [1024, 2048] and down_proj [1024, 3072] up to 16 rows, but the
# skinny GEMM was as fast or faster at every one of those points behind the norm (o_proj M=1: 4.38 vs 4.19; down
# M=8: 5.75 vs 5.36), and alone too except down M=1 and 8 (5.85 vs 5.96, 5.95 vs 6.05: under 2%, and measured
# in a different run). tests/test_decode_gemm.py derives this table from that file. The execution plan puts
# a layer on the kernel only where this table and covers() both say so.
MEASURED_WINS: dict[tuple[int, int], int] = {}
MEASURED_AT = "5671c98"


def batch_blocks(m: int) -> int:
    """k32 blocks per register batch (batch_blocks(NT) in the kernel): 2 for 16 < M <= 32, else 4."""
    return 2 if 16 < m <= 32 else 4


def ctas_per_sm(m: int) -> int:
    """Resident CTAs per SM (the kernel's __launch_bounds__): 2 up to M = 32 (<= 128 registers), 1 above."""
    return 2 if m <= 32 else 1


def config_ok(k: int, splits: int, row_warps: int) -> bool:
    """decode_gemm_config_ok(): every warp gets at least one k32 block."""
    return (row_warps in ROW_WARPS and 1 <= splits <= MAX_SPLITS
            and splits * (WARPS // row_warps) <= k // TILE_K)


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


def layer_rows(n: int, k: int, bias: bool, dtype: torch.dtype, sm_major: int) -> tuple[int, str]:
    """Up to how many rows the plan puts an [*, k] x [n, k]^T layer on the kernel (0: never), and why: asked once
    per linear layer at engine start, so the row count is the only question left for a call."""
    if bias:
        return 0, "the layer has a bias (the kernel adds none)"
    rows = MEASURED_WINS.get((n, k), 0)
    if rows == 0:
        return 0, f"[{n}, {k}] measured no faster than cuBLAS and the skinny GEMM (MEASURED_WINS, {MEASURED_AT})"
    why = covers(rows, n, k, dtype, sm_major)
    if why is not None:
        return 0, why
    return rows, f"[{n}, {k}] at up to {rows} rows (measured faster than cuBLAS and the skinny GEMM, {MEASURED_AT})"


# Model constants (to be checked against scripts/gemm_sweep.py's best configuration, not measurements):
HBM_BYTES_PER_US = 3.3e6   # weight streaming rate with enough bytes in flight
LATENCY_US = 1.0           # loaded HBM round trip: bytes in flight / LATENCY_US bounds the rate (Little's law)
SM_BYTES_PER_US = 3.0e4    # what one SM is assumed to pull at most (~30 GB/s): idle SMs cost bandwidth
L2_BYTES_PER_US = 6.0e6    # L2 -> SM rate that the weights and every CTA's copy of x share
BATCH_US = 0.5             # per register batch of a warp: a ~1 us round trip with two batches in flight
FIXED_US = 0.8             # launch ramp, first-load latency, the CTA's own reduction
WAVE_US = 0.5              # ramp of every further wave
CLUSTER_US = 0.5           # two cluster barriers and the DSMEM sum when splits > 1
GPC_SMS = 16               # a cluster lives in one GPC (H100/H200: 16-18 SMs each)


def slots(m: int, splits: int, num_sms: int) -> int:
    """CTAs resident at once. Clusters pack per GPC: (SMs / 16) x (16 x CTAs per SM // splits) less 2, which
    matches the `Max Active Clusters` ncu reported for the first kernel (62 of size 6 at 3 CTAs per SM, 30 of size
    4 at 1)."""
    cps = ctas_per_sm(m)
    if splits == 1:
        return num_sms * cps
    return max(1, num_sms // GPC_SMS * (GPC_SMS * cps // splits) - 2) * splits


def model_us(m: int, n: int, k: int, splits: int, row_warps: int, num_sms: int) -> float:
    """Modelled time of one configuration, summed over its waves: each the larger of streaming its share (HBM,
    capped by the bytes its warps keep in flight and by the SMs it occupies; or L2, with every CTA's copy of x)
    and a warp's chain of batch round trips; plus fixed costs."""
    ctas = n // (16 * row_warps) * splits
    wave = slots(m, splits, num_sms)
    w_bytes, x_bytes = n * k * 2, ctas * m * (k // splits) * 2
    kb_warp = -(-(k // TILE_K) // (splits * (WARPS // row_warps)))
    chain = -(-kb_warp // batch_blocks(m)) * BATCH_US
    waves = [wave] * (ctas // wave) + ([ctas % wave] if ctas % wave else [])
    total = 0.0
    for c in waves:
        in_flight = c * WARPS * 2 * batch_blocks(m) * 1024   # two batches of U x 1 KB per warp
        sms = min(num_sms, c)   # the block scheduler spreads a wave over the SMs first
        rate = min(HBM_BYTES_PER_US, in_flight / LATENCY_US, sms * SM_BYTES_PER_US)
        share = c / ctas
        total += max(w_bytes * share / rate, (w_bytes + x_bytes) * share / L2_BYTES_PER_US, chain)
    return total + FIXED_US + (len(waves) - 1) * WAVE_US + (CLUSTER_US if splits > 1 else 0.0)


def configs(k: int) -> list[tuple[int, int]]:
    """Every legal (splits, row_warps) for this K."""
    return [(s, rw) for rw in ROW_WARPS for s in range(1, MAX_SPLITS + 1) if config_ok(k, s, rw)]


@lru_cache(maxsize=1024)
def choose_config(m: int, n: int, k: int, num_sms: int) -> tuple[int, int]:
    """(splits, row_warps) with the smallest modelled time; ties go to fewer splits, then more row warps."""
    return min(configs(k), key=lambda c: (round(model_us(m, n, k, *c, num_sms), 3), c[0], -c[1]))


@lru_cache(maxsize=8)
def _device(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.major, props.multi_processor_count


def decode_gemm(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int] | None = None) -> torch.Tensor:
    """y = x w^T on the decode GEMM kernel; config = (splits, row_warps), None: choose_config. Raises ValueError
    naming the reason when covers() refuses the shape."""
    if not (x.is_cuda and w.is_cuda) or x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"decode_gemm needs CUDA tensors x [M, K] and w [N, K], got {tuple(x.shape)} on "
                         f"{x.device} and {tuple(w.shape)} on {w.device}")
    major, sms = _device(x.device.index or 0)
    (m, k), n = x.shape, w.shape[0]
    reason = covers(m, n, k, x.dtype, major)
    if reason is not None:
        raise ValueError(f"decode_gemm does not apply: {reason}")
    return run(x, w, sms, config)


def run(x: torch.Tensor, w: torch.Tensor, num_sms: int, config: tuple[int, int] | None = None) -> torch.Tensor:
    """The kernel without the checks: for callers whose shape the plan has already covered (gemm_ops.linear)."""
    (m, k), n = x.shape, w.shape[0]
    splits, row_warps = choose_config(m, n, k, num_sms) if config is None else config
    return torch.ops.minillm.decode_gemm(x, w, splits, row_warps)
