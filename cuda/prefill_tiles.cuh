// The K/V tile copies the paged prefill kernels share (paged_prefill.cu, prefill_wide.cu, prefill_wgmma.cu): a
// tile of BN keys of one KV head, gathered token by token through the block table with cp.async into swizzled
// shared memory. Each of a CTA's THREADS threads copies one 16-byte piece (column c) of every (THREADS / CH)-th
// row of the tile, from row r0 on, and computes the cache slots of those rows once per tile, for its K and its V copy.
#pragma once

#include <stdint.h>

#include "attention.h"
#include "common.cuh"

namespace minillm {

template <int D, int THREADS, int BN>
struct TileCopy {
  static constexpr int CH = D / 8, PASS = THREADS / CH, ROWS = BN / PASS;
  static_assert(THREADS % CH == 0 && BN % PASS == 0, "a tile must split evenly over the CTA's threads");
};

// Cache slots of the BN-key tile starting at n0 for the rows this thread copies; -1 past n_end. Read one tile
// ahead, so the block-table loads' latency hides behind a tile of math. Block sizes are powers of two (the
// launchers check): shifts and masks, not the ~30-instruction integer division a runtime divisor costs.
template <int D, int THREADS, int BN>
__device__ __forceinline__ void tile_slots(int (&slot)[TileCopy<D, THREADS, BN>::ROWS], const int* bt, int bs_log2,
                                           int n0, int n_end, int r0) {
  using TC = TileCopy<D, THREADS, BN>;
#pragma unroll
  for (int i = 0; i < TC::ROWS; ++i) {
    const int pos = n0 + r0 + i * TC::PASS;
    slot[i] = pos < n_end ? (bt[pos >> bs_log2] << bs_log2) | (pos & ((1 << bs_log2) - 1)) : -1;
  }
}

// wgmma's canonical 128-byte-swizzle layout (prefill_wgmma.cu) of a ROWS-row tile, in elements: column blocks
// of 64 elements (rows of 128 bytes), 16-byte chunk c of row r at chunk c ^ (r % 8) of its block. The hardware
// applies that XOR to address bits, so the tile must start on a 1024-byte boundary.
template <int ROWS>
__device__ __forceinline__ int sw128(int row, int chunk) {
  return (chunk >> 3) * (ROWS * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

// Copy those rows of K or V into swizzled shared memory (swz, or sw128 when SW128); rows with slot -1 are
// zero-filled without reading global memory (unowned cache slots may hold NaN).
template <typename T, int D, int THREADS, int BN, bool SW128 = false>
__device__ __forceinline__ void load_kv_tile(T* dst, const T* cache, const int (&slot)[TileCopy<D, THREADS, BN>::ROWS],
                                             int64_t tok_stride, int r0, int c) {
  using TC = TileCopy<D, THREADS, BN>;
#pragma unroll
  for (int i = 0; i < TC::ROWS; ++i) {
    const bool valid = slot[i] >= 0;
    const T* src = valid ? cache + (int64_t)slot[i] * tok_stride + c * 8 : cache;
    const int row = r0 + i * TC::PASS;
    cp_async16(dst + (SW128 ? sw128<BN>(row, c) : swz<D / 8>(row, c)), src, valid ? 16 : 0);
  }
}

// The CTA's Q tile: BM query rows from row m0 of a sequence whose rows start at q0 (query head h), into swizzled
// shared memory (swz, or sw128 when SW128); rows past qlen are zero-filled.
template <typename T, int D, int BM, int THREADS, bool SW128 = false>
__device__ __forceinline__ void load_q_tile(T* sQ, const PagedAttnArgs& a, int h, int q0, int m0, int qlen) {
  constexpr int CH = D / 8;
  const T* qb = static_cast<const T*>(a.q) + h * a.q_stride_h;
  for (int i = threadIdx.x; i < BM * CH; i += THREADS) {
    const int r = i / CH, c = i % CH;
    const bool valid = m0 + r < qlen;
    const T* src = valid ? qb + (int64_t)(q0 + m0 + r) * a.q_stride_t + c * 8 : qb;
    cp_async16(sQ + (SW128 ? sw128<BM>(r, c) : swz<CH>(r, c)), src, valid ? 16 : 0);
  }
}

// The launchers' shared argument check: GQA heads that divide, a power-of-two block size (the copies shift and
// mask), a query length >= 0, bf16 or fp16 activations. Head dims are each launcher's own dispatch.
inline bool prefill_args_valid(const PagedAttnArgs& a, int max_query_len) {
  const bool pow2_block = a.block_size > 0 && (a.block_size & (a.block_size - 1)) == 0;
  return a.num_kv_heads > 0 && a.num_q_heads % a.num_kv_heads == 0 && pow2_block && max_query_len >= 0 &&
         (a.dtype == ScalarType::kBFloat16 || a.dtype == ScalarType::kFloat16);
}

}  // namespace minillm
