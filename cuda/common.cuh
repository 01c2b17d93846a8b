// Shared device helpers for the attention kernels: dtype traits, 16-byte vectors, warp reductions and the
// sm_80+ primitives (cp.async, ldmatrix, mma.sync m16n8k16). CUDA headers only, no torch: CI compiles the
// kernel sources with nvcc on machines whose torch build has no CUDA headers.
#pragma once

#include <math_constants.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace minillm {

constexpr float kLog2e = 1.4426950408889634f;

// Per-dtype conversions. Pair = the 2-element vector type that one 32-bit register holds.
template <typename T> struct DType;

// Conversions go through intrinsics: torch extension builds define __CUDA_NO_HALF_CONVERSIONS__ and friends,
// which remove the implicit float <-> half/bf16 constructors.
template <> struct DType<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16(x); }
  static __device__ __forceinline__ float2 to_float2(uint32_t u) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
  }
  static __device__ __forceinline__ uint32_t from_float2(float a, float b) {
    __nv_bfloat162 p = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&p);
  }
};

template <> struct DType<__half> {
  using Pair = __half2;
  static __device__ __forceinline__ __half from_float(float x) { return __float2half(x); }
  static __device__ __forceinline__ float2 to_float2(uint32_t u) {
    return __half22float2(*reinterpret_cast<const __half2*>(&u));
  }
  static __device__ __forceinline__ uint32_t from_float2(float a, float b) {
    __half2 p = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&p);
  }
};

// 8 halves/bf16 (16 bytes) -> 8 floats.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 p = DType<T>::to_float2(w[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

__device__ __forceinline__ float warp_max_xor(float v, int from, int to) {
  // Butterfly over lane masks [from, to): every lane of the group ends with the group's maximum.
  for (int m = from; m < to; m <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

__device__ __forceinline__ float warp_sum_xor(float v, int from, int to) {
  for (int m = from; m < to; m <<= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// ---- sm_80+ asynchronous copies and tensor-core fragments -------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy; src_bytes = 0 fills the destination with zeros without reading global memory
// (used for keys past the end of a sequence, so NaN garbage in unowned cache slots is never read).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}

// D(16x8, fp32) += A(16x16) * B(16x8), A row-major, B column-major fragments.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Swizzled offset (in elements) of 16-byte chunk `chunk` of row `row` in a tile whose rows hold `chunks`
// 16-byte chunks. XOR with the row's low 3 bits puts the 8 rows an ldmatrix reads in 8 different bank groups.
template <int CHUNKS>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * CHUNKS * 8 + ((chunk ^ (row & 7)) * 8);
}

// ex2.approx.ftz: exp2 without exp2f's handling of results that would be denormal (they flush to 0, which the
// softmax's sums never notice).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// One online-softmax step for fragment row r (0: row lane/4, 1: row lane/4 + 8) of an mma.sync score tile
// sc[NT][4] (NT n8-tiles of raw scores; the 4 lanes of a quad share a row): the row's running max m and sum l move
// to this tile, its scores become probabilities in place (ready to be packed as the A operand of P V), and its
// output accumulators o[DT][4] are rescaled. sl2 = softmax scale * log2(e); m is kept in those log2 units. A row
// that has seen only masked scores (-inf) so far keeps m = -inf, l = 0 and o = 0. kFastExp: fast_exp2 instead of
// exp2f (the prefill kernels).
template <int NT, int DT, bool kFastExp = false>
__device__ __forceinline__ void online_softmax_row(float (&sc)[NT][4], float (&o)[DT][4], float& m, float& l,
                                                   float sl2, int r) {
  const auto ex2 = [](float x) { return kFastExp ? fast_exp2(x) : exp2f(x); };
  float mx = -CUDART_INF_F;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(sc[nt][2 * r], sc[nt][2 * r + 1]));
  mx = warp_max_xor(mx, 1, 4) * sl2;
  const float m_new = fmaxf(m, mx);
  const float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;
  const float alpha = ex2(m - m_use);
  m = m_new;
  float sum = 0.f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float p = ex2(sc[nt][2 * r + e] * sl2 - m_use);
      sc[nt][2 * r + e] = p;
      sum += p;
    }
  l = l * alpha + sum;
#pragma unroll
  for (int i = 0; i < DT; ++i) {
    o[i][2 * r] *= alpha;
    o[i][2 * r + 1] *= alpha;
  }
}

}  // namespace minillm
