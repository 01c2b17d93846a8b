// One pass over the constrained rows: each thread owns one logit column, reads the word holding its bit (a warp
// shares one word, so one load serves 32 threads) and writes -inf where the bit is clear. Allowed columns are
// neither read nor written, so the cost is the bitmask plus the forbidden columns' stores, coalesced per warp.
#include <cmath>

#include "grammar_mask.h"

namespace minillm {
namespace {

constexpr int kThreads = 256;

__global__ void grammar_mask_kernel(float* __restrict__ logits, int64_t row_stride,
                                    const int32_t* __restrict__ bitmask, int64_t words,
                                    const int64_t* __restrict__ rows, int64_t vocab) {
  const int64_t r = blockIdx.y;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (col >= vocab) return;
  const uint32_t word = static_cast<uint32_t>(bitmask[r * words + (col >> 5)]);
  if ((word >> (col & 31)) & 1u) return;
  const int64_t row = rows != nullptr ? rows[r] : r;
  logits[row * row_stride + col] = -INFINITY;
}

}  // namespace

cudaError_t launch_grammar_mask(float* logits, int64_t row_stride, const int32_t* bitmask, int64_t words,
                                const int64_t* rows, int64_t num_rows, int64_t vocab, cudaStream_t stream) {
  if (num_rows == 0 || vocab == 0) return cudaSuccess;
  if (num_rows > 65535 || (vocab + 31) / 32 > words) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((vocab + kThreads - 1) / kThreads), static_cast<unsigned>(num_rows));
  grammar_mask_kernel<<<grid, kThreads, 0, stream>>>(logits, row_stride, bitmask, words, rows, vocab);
  return cudaGetLastError();
}

}  // namespace minillm
