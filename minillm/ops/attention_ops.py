"""Typed wrappers of the CUDA attention ops (torch.ops.minillm.*) and the decode dispatcher.

Shapes follow minillm.attention.metadata: q [rows, Hq, D]; caches [num_blocks, block_size, Hkv, D];
block_tables int32 [S, max_blocks]; seq_lens int32 [S]; query_start_loc int32 [S + 1]; slot_mapping int64.
Every function writes into caller-owned tensors and allocates nothing that depends on device data, so the
decode path can be captured in a CUDA graph.
"""
from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

import torch
import torch.nn.functional as F

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
# caches) are opt-in until measured: the engine never runs them. prefill_kernel() picks the one a case runs on: wide
# wherever it covers the case.
PREFILL_KERNELS = ("wide", "narrow", "wgmma", "wgmma1")
_WGMMA_WARPGROUPS = {"wgmma": 2, "wgmma1": 1}
PREFILL_WIDE_COVERAGE = KernelCoverage("paged_prefill_wide", dtypes=COVERAGE.dtypes, head_dims=COVERAGE.head_dims,
                                       block_sizes=COVERAGE.block_sizes, max_gqa_group=COVERAGE.max_gqa_group,
                                       graph_safe=True)
PREFILL_WGMMA_COVERAGE = dataclasses.replace(PREFILL_WIDE_COVERAGE, family="paged_prefill_wgmma",
                                             min_capability=(9, 0), max_major=9)
_PREFILL_COVERAGE = {"wide": PREFILL_WIDE_COVERAGE, "narrow": COVERAGE, "wgmma": PREFILL_WGMMA_COVERAGE,
                     "wgmma1": PREFILL_WGMMA_COVERAGE}

# Whole prompts (one chunk, no cached prefix) of at least kernels.prefill_sdpa_min_tokens tokens run on torch SDPA,
# which dispatches to flash attention for these dtypes on sm_80+: measured 1.6-1.9x faster than the wide kernel from
# 4096 to 32768 tokens (results/prefill_kernels.jsonl, 27c2e6b). Native caches only: over an fp8 cache every later
# chunk and decode step reads the quantized k/v, so the prompt's own rows read them too (the narrow kernel). Not
# graph-safe (per-sequence shapes from host lists); only prefill steps, which run eagerly, take it.
PREFILL_SDPA_COVERAGE = KernelCoverage("prefill_sdpa", dtypes=COVERAGE.dtypes, head_dims=COVERAGE.head_dims,
                                       graph_safe=False)

# Prefill chunks over a cached prefix (a later chunk of a chunked prompt, a prefix-cache hit) of at least that many
# queries run on FlashAttention-2's variable-length forward through ATen (torch.ops.aten._flash_attention_forward),
# all of a step's such chunks in one call, over their K/V gathered from the paged cache into one contiguous buffer
# (FA2's own paged mode needs pages of a multiple of 256 tokens). FA2 aligns a chunk's causal mask to the
# bottom-right corner when it has fewer queries than keys: query i of n sees keys [0, L - n + i]. Same dtypes, head
# dims and native caches as PREFILL_SDPA_COVERAGE (FA2 itself takes head dims up to 256; the paged kernels that
# write the cache cover 64 and 128); the op must exist in the torch build (flash_varlen_available). Not graph-safe.
PREFILL_FLASH_VARLEN_COVERAGE = dataclasses.replace(PREFILL_SDPA_COVERAGE, family="prefill_flash_varlen")

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
def prefill_kernel(dtype: str, kv_dtype: str, head_dim: int) -> str:
    """The prefill kernel (PREFILL_KERNELS) for activations of `dtype` over a cache of `kv_dtype` (torch names
    without "torch."): the wide one wherever its coverage holds, else the narrow one."""
    wide = PREFILL_WIDE_COVERAGE.reason(dtype=dtype, capability=PREFILL_WIDE_COVERAGE.min_capability,
                                        head_dim=head_dim, kv_dtype=kv_dtype)
    return "narrow" if wide else "wide"


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
    kernel: one of PREFILL_KERNELS; None lets prefill_kernel() choose (what the engine runs).
    """
    if num_seqs is None:
        num_seqs = seq_lens.shape[0] - seq_begin
    if kernel is None:
        kernel = prefill_kernel(_dtype_name(q.dtype), _dtype_name(k_cache.dtype), q.shape[-1])
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


def prefill_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one whole prompt: q [L, Hq, D], k/v [L, Hkv, D] (its own keys, no prefix) ->
    [L, Hq, D]. The [1, H, L, D] views SDPA takes are the [L, H, D] rows unchanged (flash reads that layout)."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def flash_varlen_available() -> bool:
    """Whether this torch build registers ATen's variable-length flash-attention forward (the plan asks once)."""
    return hasattr(torch.ops.aten, "_flash_attention_forward")


def prefill_flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                         max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """Causal attention of several sequences in one call: q [total_q, Hq, D] (rows cu_q[s]:cu_q[s+1] are sequence
    s's queries), k/v [total_k, Hkv, D] (rows cu_k[s]:cu_k[s+1] its whole context, GQA not expanded), cu_q / cu_k
    int32 [S + 1] on the device, max_q / max_k host bounds of the per-sequence counts -> [total_q, Hq, D].
    A sequence's queries are the last of its context (bottom-right causal alignment: query i of n sees its first
    L - n + i + 1 keys), which is what FA2 does for is_causal with fewer queries than keys."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, int(max_q), int(max_k), 0.0, True, False,
                                                   scale=float(scale))[0]
