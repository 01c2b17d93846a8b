// The K/V tile copies both paged prefill kernels share (paged_prefill.cu, prefill_wide.cu): a kBN-key tile of
// one KV head, gathered token by token through the block table with cp.async into XOR-swizzled shared memory.
// Each of a CTA's THREADS threads copies one 16-byte piece (column c) of every (THREADS / CH)-th row of the
// tile, from row r0 on, and computes the cache slots of those rows once per tile, for its K and its V copy.
#pragma once

#include <stdint.h>

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

// Copy those rows of K or V into swizzled shared memory; rows with slot -1 are zero-filled without reading
// global memory (unowned cache slots may hold NaN).
template <typename T, int D, int THREADS, int BN>
__device__ __forceinline__ void load_kv_tile(T* dst, const T* cache, const int (&slot)[TileCopy<D, THREADS, BN>::ROWS],
                                             int64_t tok_stride, int r0, int c) {
  using TC = TileCopy<D, THREADS, BN>;
#pragma unroll
  for (int i = 0; i < TC::ROWS; ++i) {
    const bool valid = slot[i] >= 0;
    const T* src = valid ? cache + (int64_t)slot[i] * tok_stride + c * 8 : cache;
    cp_async16(dst + swz<D / 8>(r0 + i * TC::PASS, c), src, valid ? 16 : 0);
  }
}

}  // namespace minillm
