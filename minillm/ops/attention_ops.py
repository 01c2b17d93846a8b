"""Typed wrappers of the CUDA attention ops (torch.ops.minillm.*) and the decode dispatcher.

Shapes follow minillm.attention.metadata: q [rows, Hq, D]; caches [num_blocks, block_size, Hkv, D];
block_tables int32 [S, max_blocks]; seq_lens int32 [S]; query_start_loc int32 [S + 1]; slot_mapping int64.
Every function writes into caller-owned tensors and allocates nothing that depends on device data, so the
decode path can be captured in a CUDA graph.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import torch

from minillm.ops.build import load_extension
from minillm.ops.coverage import KernelCoverage

# What the KV write, paged decode and paged prefill launchers accept together (cuda/attention_bindings.cpp,
# paged_decode.cu: dispatch_shape and kMaxGroup; paged_prefill takes any power-of-two block size, decode only
# these). The decode path sizes its workspace from host values and never syncs, so it can be captured.
COVERAGE = KernelCoverage("paged_attention", dtypes=("bfloat16", "float16"), head_dims=(64, 128),
                          block_sizes=(16, 32), max_gqa_group=16, graph_safe=True,
                          kv_dtypes=("float8_e4m3fn", "float8_e5m2"))   # fp8 caches: cuda/kv_fp8.cuh

# The prefill kernels, one contract: "wide" (cuda/prefill_wide.cu: 128-query tiles, 32 rows per warp) reads
# caches in the activation dtype; "narrow" (cuda/paged_prefill.cu: 64-query tiles, 16 rows per warp) reads those
# and the fp8 caches; "wgmma" and "wgmma1" (cuda/prefill_wgmma.cu: 2 warpgroups per CTA or 1, sm_90 only, native
# caches). prefill_kernel() picks the one a case runs on: wgmma on sm_90 (measured 1-7% faster than wide on every
# shape of scripts/prefill_bench.py, 4k-32k tokens and chunks over 14k-16k prefixes, b6899bc), else wide wherever
# its coverage holds, else narrow.
PREFILL_KERNELS = ("wide", "narrow", "wgmma", "wgmma1")
_WGMMA_WARPGROUPS = {"wgmma": 2, "wgmma1": 1}
PREFILL_WIDE_COVERAGE = KernelCoverage("paged_prefill_wide", dtypes=COVERAGE.dtypes, head_dims=COVERAGE.head_dims,
                                       block_sizes=COVERAGE.block_sizes, max_gqa_group=COVERAGE.max_gqa_group,
                                       graph_safe=True)
PREFILL_WGMMA_COVERAGE = dataclasses.replace(PREFILL_WIDE_COVERAGE, family="paged_prefill_wgmma",
                                             min_capability=(9, 0), max_major=9)
_PREFILL_COVERAGE = {"wide": PREFILL_WIDE_COVERAGE, "narrow": COVERAGE, "wgmma": PREFILL_WGMMA_COVERAGE,
                     "wgmma1": PREFILL_WGMMA_COVERAGE}

# Long prefill chunks on cuDNN's fused attention (torch.ops.aten._scaled_dot_product_cudnn_attention, what torch
# SDPA dispatches to on sm_90): whole prompts of at least kernels.prefill_sdpa_min_tokens tokens, and with
# kernels.prefill_sdpa_prefix chunks of that many queries over a cached prefix (prefill_cudnn). On the H200 it ran
# causal 4k-16k at 450-660 TFLOP/s against 290-340 for the wgmma kernel, and 16k queries over a 16k prefix in
# 10.2 ms against 19.2 for FA2's varlen forward (8B heads, 2cf2517). cuDNN builds an execution plan per call shape
# (~40 ms on the H200, and ~0.5-1 s the first time a kernel variant is compiled), so call shapes are rounded to
# CUDNN_STEPS_PER_OCTAVE steps per power of two (cudnn_quantum). Native caches only: over an fp8 cache every later
# chunk and decode step reads the quantized k/v, so the prompt's own rows read them too (the narrow kernel). Not
# graph-safe (per-sequence shapes from host lists); only prefill steps, which run eagerly, take it.
PREFILL_SDPA_COVERAGE = KernelCoverage("prefill_cudnn", dtypes=COVERAGE.dtypes, head_dims=COVERAGE.head_dims,
                                       min_capability=(8, 0), graph_safe=False)
CUDNN_MIN_QUANTUM = 256
CUDNN_STEPS_PER_OCTAVE = 16

PARTITION_QUANTUM = 256   # fixed split-K partitions are multiples of this (a whole number of chunks per warp)
# Equal split-K policy: cut every sequence into as many partitions as fit the grid into CTAS_PER_SM_TARGET CTAs per
# SM (rounded down, each >= 256 tokens, the kernel's rule, so a short context uses fewer), and at least
# MIN_PARTITIONS. 2 is what the kernel keeps resident per SM (96 KB of shared memory each), so the default is one
# wave. The kernel alone once favoured ~4 waves (8 per SM, rounded up: the ragged sweep of 317eff9 in
# results/decode_sweep.jsonl). In whole decode steps, where every split also costs the reduce kernel and each
# CTA's fixed costs, fewer won: interleaved engine runs (H200, 128-token prompts, 512 steps; 88c3857, 9769c5f) gave
# ms per step for 8 / 2 / 1 CTAs per SM rounded up (3-5, 2, 1 partitions at B=20-48): B=20 1.64 / 1.65 / 1.53,
# B=32 1.78 / 1.78 / 1.61, B=48 2.01 / 1.92 / 1.92, B=64 2.20 / 2.04 / -, B=128 2.99 / 2.83 / -; one wave rounded
# down gives one partition at all of these. At B=8, 4k tokens (check-kernels) 4 partitions (this rule) read
# 3.43 and 3.11 TB/s in two runs (a6f9cda, d106639), 3 partitions 2.99, 8 3.13. The offline reference lost ~0.9% against 8 rounded up (its tail: a few long
# sequences, which splitting balanced). Both numbers are config keys (kernels.decode_min_partitions,
# kernels.decode_ctas_per_sm) with these defaults, so an A/B needs no rebuild.
MIN_PARTITIONS = 1
CTAS_PER_SM_TARGET = 2
MAX_EQUAL_PARTITIONS = 32  # 8,192 tokens in 256-token pieces for a single sequence
MIN_SPLIT_LEN = 256        # contexts this short are never split


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Scatter k/v [T, Hkv, D] into the caches at slot_mapping[:T] (-1 = skip). Bit-exact copy; into an fp8 cache,
    quantized with the per-KV-head fp32 scales (bit for bit minillm/ops/kv_quant.py's quantize)."""
    if k_scale is None:
        load_extension().kv_write(k, v, k_cache, v_cache, slot_mapping)
    else:
        load_extension().kv_write_fp8(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_partition_size(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132,
                          min_partitions: int = MIN_PARTITIONS, ctas_per_sm: int = CTAS_PER_SM_TARGET) -> int:
    """The decode kernel's split-K argument: 0 for v1 (one CTA per sequence x KV head), or -P to cut every
    sequence into P equal partitions (see cuda/paged_decode.cu).

    P depends on the batch size only, never on the contexts, so a CUDA graph captured for a batch-size bucket
    launches the same grid as eager mode and no CTA is launched for a partition past a short context.
    """
    if max_seq_len <= MIN_SPLIT_LEN:
        return 0
    fill = ctas_per_sm * num_sms // max(num_seqs * num_kv_heads, 1)
    parts = min(MAX_EQUAL_PARTITIONS, max(min_partitions, fill))
    return 0 if parts <= 1 else -parts


def paged_decode(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seq_len: int,
                 partition_size: int | None = None, *, min_partitions: int = MIN_PARTITIONS,
                 ctas_per_sm: int = CTAS_PER_SM_TARGET, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """out[s] = attention of q[s] (one token per sequence) over its first seq_lens[s] cached tokens.

    partition_size None lets the dispatcher choose; 0 forces v1; a positive multiple of 256 forces split-K with
    fixed partitions of that many tokens; -P forces split-K with every sequence cut into P equal partitions.
    max_seq_len must bound every seq_lens entry (it sizes the fixed split-K workspace).
    k_scale / v_scale (fp32 [Hkv]): the caches are fp8, read as stored * scale.
    """
    if partition_size is None:
        partition_size = decode_partition_size(q.shape[0], k_cache.shape[2], max_seq_len, _num_sms(q.device.index or 0),
                                               min_partitions, ctas_per_sm)
    fixed_ok = partition_size >= 0 and partition_size % PARTITION_QUANTUM == 0
    if not (fixed_ok or -MAX_EQUAL_PARTITIONS <= partition_size < 0):
        raise ValueError(f"partition_size must be 0, a positive multiple of {PARTITION_QUANTUM} or -P with "
                         f"1 <= P <= {MAX_EQUAL_PARTITIONS}, got {partition_size}")
    if k_scale is None:
        load_extension().paged_decode(out, q, k_cache, v_cache, block_tables, seq_lens, float(scale),
                                      int(partition_size), int(max_seq_len))
    else:
        load_extension().paged_decode_fp8(out, q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale,
                                          float(scale), int(partition_size), int(max_seq_len))
    return out


@lru_cache(maxsize=32)
def prefill_kernel(dtype: str, kv_dtype: str, head_dim: int, capability: tuple[int, int] | None = None) -> str:
    """The prefill kernel (PREFILL_KERNELS) for activations of `dtype` over a cache of `kv_dtype` (torch names
    without "torch.") on a GPU of `capability` (None: any the wide kernel runs on): wgmma where it covers the case,
    else the wide one wherever its coverage holds, else the narrow one."""
    case = dict(dtype=dtype, head_dim=head_dim, kv_dtype=kv_dtype)
    if capability is not None and PREFILL_WGMMA_COVERAGE.reason(capability=tuple(capability), **case) is None:
        return "wgmma"
    return "narrow" if PREFILL_WIDE_COVERAGE.reason(capability=PREFILL_WIDE_COVERAGE.min_capability, **case) \
        else "wide"


def prefill_kernels_on(capability: tuple[int, int]) -> tuple[str, ...]:
    """The PREFILL_KERNELS a GPU of this capability runs (the tests and scripts/prefill_bench.py try each)."""
    return tuple(k for k in PREFILL_KERNELS
                 if _PREFILL_COVERAGE[k].reason(dtype=COVERAGE.dtypes[0], capability=tuple(capability)) is None)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def paged_prefill(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                  scale: float, max_query_len: int, seq_begin: int = 0, num_seqs: int | None = None, *,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  kernel: str | None = None) -> torch.Tensor:
    """Causal attention of the query rows of sequences [seq_begin, seq_begin + num_seqs) in one launch.

    Rows of sequence s are q[query_start_loc[s]:query_start_loc[s+1]] and sit at the last positions of its
    seq_lens[s]-token context (prefix hits and later prefill chunks attend to the cached tokens before them).
    k_scale / v_scale (fp32 [Hkv]): the caches are fp8, read as stored * scale.
    kernel: one of PREFILL_KERNELS; None lets prefill_kernel() choose for q's GPU (what the engine runs).
    """
    if num_seqs is None:
        num_seqs = seq_lens.shape[0] - seq_begin
    if kernel is None:
        kernel = prefill_kernel(_dtype_name(q.dtype), _dtype_name(k_cache.dtype), q.shape[-1],
                                torch.cuda.get_device_capability(q.device) if q.is_cuda else None)
    if kernel not in PREFILL_KERNELS:
        raise ValueError(f"prefill kernel must be one of {PREFILL_KERNELS}, got {kernel!r}")
    if kernel != "narrow":
        if k_scale is not None:
            raise ValueError(f"the {kernel} prefill kernel reads caches in the activation dtype, not fp8 ones")
        args = (out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, int(seq_begin), int(num_seqs),
                int(max_query_len), float(scale))
        if kernel == "wide":
            load_extension().paged_prefill_wide(*args)
        else:
            load_extension().paged_prefill_wgmma(*args, _WGMMA_WARPGROUPS[kernel])
    elif k_scale is None:
        load_extension().paged_prefill(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                       int(seq_begin), int(num_seqs), int(max_query_len), float(scale))
    else:
        load_extension().paged_prefill_fp8(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                           k_scale, v_scale, int(seq_begin), int(num_seqs), int(max_query_len),
                                           float(scale))
    return out


def cudnn_attention_available() -> bool:
    """Whether this torch build registers cuDNN's fused attention op (the plan asks once; CUDA builds of torch
    ship cuDNN with it)."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")


def cudnn_quantum(n: int) -> int:
    """The length step of cuDNN call shapes near n tokens: 1/CUDNN_STEPS_PER_OCTAVE of the power of two below n,
    at least CUDNN_MIN_QUANTUM. Rounding up to it pads at most 1/16 of the rows; every shape is a multiple of 256."""
    return max(CUDNN_MIN_QUANTUM, (1 << (max(n, 1).bit_length() - 1)) // CUDNN_STEPS_PER_OCTAVE)


def _round_up(n: int) -> int:
    step = cudnn_quantum(n)
    return -(-n // step) * step


def prefill_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence's n newest tokens over its whole context: q [n, Hq, D], k/v [L, Hkv, D]
    (L >= n; the first L - n rows are the cached prefix) -> [n, Hq, D].

    Two cuDNN calls of rounded shapes, merged by their log-sum-exps: the queries over the prefix's first P' rows
    (P' the prefix rounded down to its quantum; no mask), and a causal square over the rest of the context whose
    first r = L - n - P' rows (the prefix's remainder) get placeholder queries, so that query i sees exactly the
    remainder and its own first i + 1 keys. Both are zero-padded at the end to a rounded length: under a causal
    mask padding rows see only what comes before them, and padded query rows are dropped."""
    n, ctx = q.shape[0], k.shape[0]
    prefix = ctx - n
    split = prefix // cudnn_quantum(prefix) * cudnn_quantum(prefix) if prefix else 0
    r = prefix - split
    rows = _round_up(r + n)
    own, lse_own = _cudnn_call(_padded(q, rows, r), _padded(k[split:], rows), _padded(v[split:], rows), True, scale)
    own, lse_own = own[:, r:r + n], lse_own[:, r:r + n]
    if not split:
        return own.transpose(0, 1)
    rows = _round_up(n)
    pre, lse_pre = _cudnn_call(_padded(q, rows), k[:split], v[:split], False, scale)
    # softmax over both parts: each part's output weighted by its share of the total mass, exp(lse) of each
    share = torch.sigmoid(lse_pre[:, :n] - lse_own).to(own.dtype)
    return torch.lerp(own, pre[:, :n], share).transpose(0, 1)


def _padded(x: torch.Tensor, rows: int, at: int = 0) -> torch.Tensor:
    """x [m, H, D] copied to rows [at, at + m) of a zeroed contiguous [rows, H, D] (one layout per shape, so every
    call of a shape finds the same cuDNN plan)."""
    out = x.new_zeros(rows, *x.shape[1:])
    out[at:at + x.shape[0]] = x
    return out


def _cudnn_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """cuDNN attention of [rows, H, D] tensors (GQA not expanded) -> (out [Hq, rows, D], lse fp32 [Hq, rows, 1])."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), None, True,
        0.0, causal, False, scale=float(scale))[:2]
    return out[0], lse[0].reshape(out.shape[1], out.shape[2], 1)


def warm_up_cudnn(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
    """One chunk over a prefix through prefill_cudnn, so that both of its kernel variants (causal and not) are
    compiled at start-up rather than in the first long prompt's time to first token."""
    q = torch.zeros(CUDNN_MIN_QUANTUM, num_q_heads, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(2 * CUDNN_MIN_QUANTUM, num_kv_heads, head_dim, dtype=dtype, device=device)
    prefill_cudnn(q, kv, kv, head_dim ** -0.5)
