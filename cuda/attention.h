// Plain C++ launchers of the attention kernels (raw pointers, sizes, strides, stream). No torch types here:
// cuda/attention_bindings.cpp turns tensors into these arguments. Strides are in elements. Every launcher
// returns cudaSuccess, cudaErrorInvalidValue for an unsupported configuration, or the launch error.
//
// KV cache layout (per layer): k_cache, v_cache contiguous [num_blocks, block_size, num_kv_heads, head_dim];
// flat slot = block_id * block_size + offset. Element type: bf16 or fp16 (ScalarType, dtype.h).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "dtype.h"

namespace minillm {

// Scatter this step's new K/V rows ([T, H, D] with strides) into their cache slots; slot -1 = skip.
// head_dim must be a multiple of 8 and every row 16-byte aligned (16-byte vector copies).
cudaError_t launch_kv_write(const void* k, const void* v, int64_t k_stride_t, int64_t k_stride_h,
                            int64_t v_stride_t, int64_t v_stride_h, void* k_cache, void* v_cache,
                            const int64_t* slot_mapping, int num_tokens, int num_heads, int head_dim,
                            cudaStream_t stream);

// The same into an fp8 cache (cache_dtype kFloat8E4M3 / kFloat8E5M2; k/v bf16 or fp16): every element is
// stored as fp8(x * (1 / scale[head])), saturating; k_scale / v_scale are fp32 [num_heads] on the device.
cudaError_t launch_kv_write_fp8(const void* k, const void* v, int64_t k_stride_t, int64_t k_stride_h,
                                int64_t v_stride_t, int64_t v_stride_h, void* k_cache, void* v_cache,
                                const int64_t* slot_mapping, const float* k_scale, const float* v_scale,
                                int num_tokens, int num_heads, int head_dim, ScalarType dtype,
                                ScalarType cache_dtype, cudaStream_t stream);

struct PagedAttnArgs {
  void* out;                 // [rows, Hq, D]
  int64_t out_stride_t, out_stride_h;
  const void* q;             // [rows, Hq, D]
  int64_t q_stride_t, q_stride_h;
  const void* k_cache;       // contiguous cache layout above
  const void* v_cache;
  const int* block_tables;   // [S, max_blocks]
  int64_t bt_stride;
  const int* seq_lens;       // [S]: context length including this step's tokens
  int num_seqs, num_q_heads, num_kv_heads, head_dim, block_size;
  float scale;
  ScalarType dtype;               // kBFloat16 or kFloat16
};

// An fp8 cache (kv_fp8.cuh): its element type (kFloat8E4M3 / kFloat8E5M2) and fp32 [num_kv_heads] scales; a value
// is read as stored * scale. Kept out of PagedAttnArgs: a larger argument struct alone costs the head-dim-64 decode
// kernel 26 registers. Null = the cache holds the activation dtype.
struct KvQuant {
  ScalarType cache_dtype;
  const float* k_scale;
  const float* v_scale;
};

// Decode: one query row per sequence (row s of q belongs to sequence s).
// partition_size == 0: one CTA per (seq, kv head) covers the whole context (v1) and writes `out` directly.
// partition_size > 0 (a multiple of 256): split-K v2, num_partitions CTAs per (seq, kv head) write partial
// results to the fp32 workspace (ws_out [S, Hq, num_partitions, D], ws_max/ws_sum [S, Hq, num_partitions],
// max in log2 units) and a reduce kernel merges them into `out`. num_partitions must cover the longest context.
// partition_size = -P (P = num_partitions): split-K with every sequence cut into P equal partitions.
cudaError_t launch_paged_decode(const PagedAttnArgs& a, int partition_size, int num_partitions, float* ws_out,
                                float* ws_max, float* ws_sum, cudaStream_t stream, const KvQuant* quant = nullptr);

// Prefill / chunked prefill / prefix hits, causal, tensor cores: sequences [seq_begin, seq_begin + a.num_seqs)
// of the batch (block_tables, seq_lens and query_start_loc are indexed with the absolute sequence index);
// query i of sequence s sits at position seq_len - query_len + i. One launch for all of them.
cudaError_t launch_paged_prefill(const PagedAttnArgs& a, const int* query_start_loc, int seq_begin,
                                 int max_query_len, cudaStream_t stream, const KvQuant* quant = nullptr);

// The same contract on 128-query tiles with 32 rows per warp (cuda/prefill_wide.cu), for caches in the activation
// dtype only; attention_ops.prefill_kernel chooses between the two.
cudaError_t launch_paged_prefill_wide(const PagedAttnArgs& a, const int* query_start_loc, int seq_begin,
                                      int max_query_len, cudaStream_t stream);

// The same on Hopper's wgmma (cuda/prefill_wgmma.cu), sm_90 only (cudaErrorNotSupported elsewhere), native caches;
// warpgroups (1 or 2) per CTA picks its shape.
cudaError_t launch_paged_prefill_wgmma(const PagedAttnArgs& a, const int* query_start_loc, int seq_begin,
                                       int max_query_len, cudaStream_t stream, int warpgroups);

}  // namespace minillm
