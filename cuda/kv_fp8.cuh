// FP8 KV-cache element conversions, the device side of minillm/ops/kv_quant.py: stored = fp8(x * (1 / scale)),
// round to nearest even, saturating to the largest finite value (inf included; NaN stays NaN, as torch's
// clamp-then-cast leaves it), read back exactly as bf16 / fp16 (every e4m3 and e5m2 value is exact in both).
// The scale is applied outside: to the fp32 scores (K) and to the output (V), never to a widened copy.
// (e5m2 inf never occurs in a cache: the write saturates it; a NaN stays NaN.)
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

// ---- in-register widening for the mma B operands (paged_decode.cu) ------------------------------------------
// Each returns two fp8 elements of a 32-bit word as one register of two fp16 (low half = lower byte), exactly:
// bytes 0-1 (lo) or 2-3 (hi). e4m3 uses the hardware conversion; e5m2 is the top byte of an fp16, so a byte move.
template <int CF>
__device__ __forceinline__ uint32_t fp8x2_lo_to_half2(uint32_t w) {
  if constexpr (CF == kCacheE5M2) {
    return __byte_perm(w, 0u, 0x1404);
  } else {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
    return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
  }
}
template <int CF>
__device__ __forceinline__ uint32_t fp8x2_hi_to_half2(uint32_t w) {
  if constexpr (CF == kCacheE5M2) {
    return __byte_perm(w, 0u, 0x3424);
  } else {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
    return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
  }
}

// Four fp8 elements -> two registers of two bf16, exactly, without a conversion instruction (those issue at a
// fraction of the integer rate): each byte's 7 exponent and mantissa bits move into bf16's fields, which reads the
// value 2^-120 (e4m3) / 2^-112 (e5m2) times too small, subnormals included, and one bf16 multiply by that power
// of two (exact: no rounding, and the fma path keeps subnormal inputs) restores it. Pairs bytes (0, 2) -> even
// and (1, 3) -> odd, which takes fewer shifts than (0, 1), (2, 3). An fp8 NaN comes out finite (480 for e4m3),
// so the caller checks for NaN bytes itself (fp8_nan_bits).
template <int CF>
__device__ __forceinline__ void fp8x4_to_bf16x2_split(uint32_t w, uint32_t& even, uint32_t& odd) {
  constexpr int kM = CF == kCacheE5M2 ? 5 : 4;           // bf16 mantissa bits the fp8 format lacks
  constexpr uint32_t kField = 0x7fu << kM;               // where the 7 bits land in each bf16
  constexpr uint32_t kMask = kField | (kField << 16);
  constexpr uint32_t kPow2 = CF == kCacheE5M2 ? 0x77807780u : 0x7b807b80u;  // bf16 2^112 / 2^120, twice
  const uint32_t e = ((w << 8) & 0x80008000u) | ((w << kM) & kMask);
  const uint32_t o = (w & 0x80008000u) | ((w >> (8 - kM)) & kMask);
  const __nv_bfloat162 p = *reinterpret_cast<const __nv_bfloat162*>(&kPow2);
  __nv_bfloat162 re = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&e), p);
  __nv_bfloat162 ro = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&o), p);
  even = *reinterpret_cast<uint32_t*>(&re);
  odd = *reinterpret_cast<uint32_t*>(&ro);
}

// Nonzero in some bit 7 of the result iff a byte of w is a NaN (e4m3: S.1111.111; e5m2: S.11111.xx, xx != 0):
// adding 1 (3) flips bit 7 of exactly those bytes. A NaN with its sign set carries into the next byte, which can
// only add flags where a NaN already is. OR the results over many words, then test & 0x80808080.
template <int CF>
__device__ __forceinline__ uint32_t fp8_nan_bits(uint32_t w) {
  return w ^ (w + (CF == kCacheE5M2 ? 0x03030303u : 0x01010101u));
}

}  // namespace minillm
