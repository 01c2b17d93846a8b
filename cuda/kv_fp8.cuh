// FP8 KV-cache element conversions, the device side of minillm/ops/kv_quant.py: stored = fp8(x * (1 / scale)),
// round to nearest even, saturating to the largest finite value (inf included; NaN stays NaN, as torch's
// clamp-then-cast leaves it), read back exactly as bf16 / fp16 (every e4m3 and e5m2 value is exact in both).
// The scale is applied outside: to the fp32 scores (K) and to the output (V), never to a widened copy.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <type_traits>

#include "dtype.h"

namespace minillm {

// The cache formats a kernel template is instantiated for: the activation dtype itself, or one of the fp8s.
enum CacheFormat : int { kCacheNative = 0, kCacheE4M3 = 1, kCacheE5M2 = 2 };

__host__ __device__ constexpr __nv_fp8_interpretation_t fp8_kind(int cf) { return cf == kCacheE5M2 ? __NV_E5M2 : __NV_E4M3; }

// The CacheFormat of a cache ScalarType, or -1 for one no fp8 kernel reads.
inline int cache_format_of(ScalarType cache, ScalarType act) {
  if (cache == ScalarType::kFloat8E4M3) return kCacheE4M3;
  if (cache == ScalarType::kFloat8E5M2) return kCacheE5M2;
  return cache == act ? kCacheNative : -1;
}

// x is already multiplied by 1 / scale.
template <int CF>
__device__ __forceinline__ uint8_t quantize_fp8(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, fp8_kind(CF)));
}

// Two fp8 bytes (low byte = lower element) -> one 32-bit register of two T, exactly.
template <typename T, int CF>
__device__ __forceinline__ uint32_t fp8x2_to_pair(uint16_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), fp8_kind(CF));
  if constexpr (std::is_same_v<T, __half>) {
    return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
  } else {
    __nv_bfloat162 b = __floats2bfloat162_rn(__half2float(__ushort_as_half(h.x)), __half2float(__ushort_as_half(h.y)));
    return *reinterpret_cast<uint32_t*>(&b);
  }
}

// 16 fp8 bytes -> 16 T as two 16-byte vectors (elements 0-7, 8-15).
template <typename T, int CF>
__device__ __forceinline__ void fp8x16_to_pairs(const uint4& in, uint4& lo, uint4& hi) {
  const uint32_t w[4] = {in.x, in.y, in.z, in.w};
  uint32_t o[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    o[2 * i] = fp8x2_to_pair<T, CF>(static_cast<uint16_t>(w[i] & 0xffffu));
    o[2 * i + 1] = fp8x2_to_pair<T, CF>(static_cast<uint16_t>(w[i] >> 16));
  }
  lo = make_uint4(o[0], o[1], o[2], o[3]);
  hi = make_uint4(o[4], o[5], o[6], o[7]);
}

}  // namespace minillm
