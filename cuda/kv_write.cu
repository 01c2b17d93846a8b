// KV-cache write: scatter this step's new K and V rows into their paged slots.
// One thread moves one 16-byte chunk (8 bf16/fp16 values) of K and the same chunk of V, so a warp covers
// 4 (head_dim 64) or 2 (head_dim 128) whole head rows with fully coalesced 16-byte loads and stores.
// Slots of -1 (padding rows of a CUDA-graph batch) are skipped. Pure copy: the result is bit-exact.
// An fp8 cache (launch_kv_write_fp8) takes the same 16-byte chunks of k/v and stores 8 quantized bytes each
// (kv_fp8.cuh), bit for bit what minillm/ops/kv_quant.py stores.
#include "attention.h"
#include "common.cuh"
#include "kv_fp8.cuh"
#include "launch.h"

namespace minillm {
namespace {

__global__ void kv_write_kernel(const uint4* __restrict__ k, const uint4* __restrict__ v, int64_t k_stride_t,
                                int64_t k_stride_h, int64_t v_stride_t, int64_t v_stride_h,
                                uint4* __restrict__ k_cache, uint4* __restrict__ v_cache,
                                const int64_t* __restrict__ slot_mapping, int num_tokens, int num_heads,
                                int chunks_per_row) {
  pdl_enter();  // launch.h: before the first access to memory the kernel before it touches
  // Strides arrive in 16-byte chunks (the launcher checked divisibility).
  const int64_t chunks_per_token = (int64_t)num_heads * chunks_per_row;
  const int64_t total = (int64_t)num_tokens * chunks_per_token;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int t = (int)(i / chunks_per_token);
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    const int rem = (int)(i - t * chunks_per_token);
    const int h = rem / chunks_per_row;
    const int c = rem - h * chunks_per_row;
    const int64_t dst = slot * chunks_per_token + rem;
    k_cache[dst] = k[t * k_stride_t + h * k_stride_h + c];
    v_cache[dst] = v[t * v_stride_t + h * v_stride_h + c];
  }
}

// 8 elements of one head row, multiplied by that head's 1 / scale and quantized to 8 bytes.
template <typename T, int CF>
__device__ __forceinline__ uint2 quantize8(const uint4& v, float inv) {
  float f[8];
  unpack8<T>(v, f);
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i / 4] |= static_cast<uint32_t>(quantize_fp8<CF>(f[i] * inv)) << (8 * (i % 4));
  return make_uint2(w[0], w[1]);
}

template <typename T, int CF>
__global__ void kv_write_fp8_kernel(const uint4* __restrict__ k, const uint4* __restrict__ v, int64_t k_stride_t,
                                    int64_t k_stride_h, int64_t v_stride_t, int64_t v_stride_h,
                                    uint2* __restrict__ k_cache, uint2* __restrict__ v_cache,
                                    const int64_t* __restrict__ slot_mapping, const float* __restrict__ k_scale,
                                    const float* __restrict__ v_scale, int num_tokens, int num_heads,
                                    int chunks_per_row) {
  pdl_enter();
  const int64_t chunks_per_token = (int64_t)num_heads * chunks_per_row;
  const int64_t total = (int64_t)num_tokens * chunks_per_token;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int t = (int)(i / chunks_per_token);
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    const int rem = (int)(i - t * chunks_per_token);
    const int h = rem / chunks_per_row;
    const int c = rem - h * chunks_per_row;
    const int64_t dst = slot * chunks_per_token + rem;
    k_cache[dst] = quantize8<T, CF>(k[t * k_stride_t + h * k_stride_h + c], 1.f / k_scale[h]);
    v_cache[dst] = quantize8<T, CF>(v[t * v_stride_t + h * v_stride_h + c], 1.f / v_scale[h]);
  }
}

}  // namespace

cudaError_t launch_kv_write_fp8(const void* k, const void* v, int64_t k_stride_t, int64_t k_stride_h,
                                int64_t v_stride_t, int64_t v_stride_h, void* k_cache, void* v_cache,
                                const int64_t* slot_mapping, const float* k_scale, const float* v_scale,
                                int num_tokens, int num_heads, int head_dim, ScalarType dtype,
                                ScalarType cache_dtype, cudaStream_t stream) {
  constexpr int kElemsPerChunk = 8;
  const bool aligned = head_dim % kElemsPerChunk == 0 && k_stride_t % kElemsPerChunk == 0 &&
                       k_stride_h % kElemsPerChunk == 0 && v_stride_t % kElemsPerChunk == 0 &&
                       v_stride_h % kElemsPerChunk == 0 && reinterpret_cast<uintptr_t>(k) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(v) % 16 == 0 && reinterpret_cast<uintptr_t>(k_cache) % 8 == 0 &&
                       reinterpret_cast<uintptr_t>(v_cache) % 8 == 0;
  const int cf = cache_format_of(cache_dtype, dtype);
  if (!aligned || num_heads <= 0 || cf <= 0 || k_scale == nullptr || v_scale == nullptr ||
      (dtype != ScalarType::kBFloat16 && dtype != ScalarType::kFloat16))
    return cudaErrorInvalidValue;
  if (num_tokens == 0) return cudaSuccess;
  const int chunks_per_row = head_dim / kElemsPerChunk;
  const int64_t total = (int64_t)num_tokens * num_heads * chunks_per_row;
  constexpr int kThreads = 256;
  const int blocks = (int)((total + kThreads - 1) / kThreads < 4096 ? (total + kThreads - 1) / kThreads : 4096);
  auto go = [&](auto kernel) {
    return launch_kernel(kernel, dim3(blocks), dim3(kThreads), 0, stream, static_cast<const uint4*>(k),
                         static_cast<const uint4*>(v), k_stride_t / kElemsPerChunk, k_stride_h / kElemsPerChunk,
                         v_stride_t / kElemsPerChunk, v_stride_h / kElemsPerChunk, static_cast<uint2*>(k_cache),
                         static_cast<uint2*>(v_cache), slot_mapping, k_scale, v_scale, num_tokens, num_heads,
                         chunks_per_row);
  };
  const bool bf16 = dtype == ScalarType::kBFloat16;
  if (cf == kCacheE4M3)
    return bf16 ? go(kv_write_fp8_kernel<__nv_bfloat16, kCacheE4M3>) : go(kv_write_fp8_kernel<__half, kCacheE4M3>);
  return bf16 ? go(kv_write_fp8_kernel<__nv_bfloat16, kCacheE5M2>) : go(kv_write_fp8_kernel<__half, kCacheE5M2>);
}

cudaError_t launch_kv_write(const void* k, const void* v, int64_t k_stride_t, int64_t k_stride_h,
                            int64_t v_stride_t, int64_t v_stride_h, void* k_cache, void* v_cache,
                            const int64_t* slot_mapping, int num_tokens, int num_heads, int head_dim,
                            cudaStream_t stream) {
  constexpr int kElemsPerChunk = 8;  // 16 bytes of a 2-byte dtype
  const bool aligned = head_dim % kElemsPerChunk == 0 && k_stride_t % kElemsPerChunk == 0 &&
                       k_stride_h % kElemsPerChunk == 0 && v_stride_t % kElemsPerChunk == 0 &&
                       v_stride_h % kElemsPerChunk == 0 && reinterpret_cast<uintptr_t>(k) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(v) % 16 == 0;
  if (!aligned || num_heads <= 0) return cudaErrorInvalidValue;
  if (num_tokens == 0) return cudaSuccess;
  const int chunks_per_row = head_dim / kElemsPerChunk;
  const int64_t total = (int64_t)num_tokens * num_heads * chunks_per_row;
  constexpr int kThreads = 256;
  // Cap the grid; the grid-stride loop covers the rest (a few waves of CTAs per SM is plenty for a copy).
  const int blocks = (int)((total + kThreads - 1) / kThreads < 4096 ? (total + kThreads - 1) / kThreads : 4096);
  return launch_kernel(
      kv_write_kernel, dim3(blocks), dim3(kThreads), 0, stream, static_cast<const uint4*>(k),
      static_cast<const uint4*>(v), k_stride_t / kElemsPerChunk, k_stride_h / kElemsPerChunk,
      v_stride_t / kElemsPerChunk, v_stride_h / kElemsPerChunk, static_cast<uint4*>(k_cache),
      static_cast<uint4*>(v_cache), slot_mapping, num_tokens, num_heads,
      chunks_per_row);
}

}  // namespace minillm
