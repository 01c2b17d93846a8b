// Weight-streaming loads shared by the decode GEMMs (decode_gemm.cu, moe_gemm.cu): weights are read once per
// decode step, so they skip L1 and leave L2 first. sm_80+ PTX (cache hints and policies).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace minillm {

[[maybe_unused]] __device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}

// 16 weight bytes: read once per decode step, so no L1 allocation and first out of L2. The GEMMs' lanes read 64
// bytes of each of 8 rows per load (the mma fragment layout), and the next loads the following 64 bytes of the same
// rows; the L2 prefetch-size hint has the first fetch the whole aligned 256 bytes from HBM, ahead of the loads that
// want them. Read alone, that pattern gave 3.5 TB/s on the H200, 4.4 with a 128-byte hint and 3.9 with 256
// (coalesced loads 4.45; scripts/weight_read_probe.cu); in the MoE GEMMs, whose register batches hold 128-256
// bytes of a row, 256 measured faster (results/moe_kernels.jsonl, 1b3cb90 against 9b45205).
[[maybe_unused]] __device__ __forceinline__ uint4 ld_weight(const void* p, uint64_t policy) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(policy));
  return v;
}

// 16 activation bytes through L1 (the CTAs and warps that share a row hit there).
[[maybe_unused]] __device__ __forceinline__ uint4 ld_x(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

}  // namespace minillm
