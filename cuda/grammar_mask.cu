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

// One thread polls a flag in mapped host memory until the host (or the grammar worker) stores `expect` there (the
// bitmask is in place) or -expect (the fill failed: go on, the host fails the step), or until timeout_ns has
// passed, so that a host that never answers cannot hang the stream. status[0]: 0, 2 (failed) or 1 (timed out).
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void wait_host_flag_kernel(const volatile int64_t* flag, int64_t expect, int64_t timeout_ns,
                                      int32_t* status) {
  const unsigned long long t0 = globaltimer();
  int32_t result = 1;
  while (globaltimer() - t0 < static_cast<unsigned long long>(timeout_ns)) {
    const int64_t v = *flag;
    if (v == expect || v == -expect) {
      result = v == expect ? 0 : 2;
      break;
    }
    __nanosleep(256);
  }
  // Whatever reads the bitmask after this kernel (a copy, the mask kernel) sees the stores made before the flag's.
  __threadfence_system();
  *status = result;
}

// The host-flag wait's counterpart: the step's sampled tokens into mapped host memory, then `value` into the
// flag, so that a reader that sees the flag sees the tokens (each thread fences its stores at system scope
// before the block barrier; the flag is stored after it). One block: a step samples at most a few thousand rows.
__global__ void publish_host_tokens_kernel(const int64_t* __restrict__ tokens, int64_t n, volatile int64_t* dst,
                                           volatile int64_t* flag, int64_t value) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = tokens[i];
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) *flag = value;
}

}  // namespace

cudaError_t launch_publish_host_tokens(const int64_t* tokens, int64_t n, int64_t* dst, int64_t* flag, int64_t value,
                                       cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  publish_host_tokens_kernel<<<1, 256, 0, stream>>>(tokens, n, dst, flag, value);
  return cudaGetLastError();
}

cudaError_t launch_wait_host_flag(const int64_t* flag, int64_t expect, int64_t timeout_ns, int32_t* status,
                                  cudaStream_t stream) {
  if (expect <= 0 || timeout_ns <= 0) return cudaErrorInvalidValue;
  wait_host_flag_kernel<<<1, 1, 0, stream>>>(flag, expect, timeout_ns, status);
  return cudaGetLastError();
}

cudaError_t launch_grammar_mask(float* logits, int64_t row_stride, const int32_t* bitmask, int64_t words,
                                const int64_t* rows, int64_t num_rows, int64_t vocab, cudaStream_t stream) {
  if (num_rows == 0 || vocab == 0) return cudaSuccess;
  if (num_rows > 65535 || (vocab + 31) / 32 > words) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((vocab + kThreads - 1) / kThreads), static_cast<unsigned>(num_rows));
  grammar_mask_kernel<<<grid, kThreads, 0, stream>>>(logits, row_stride, bitmask, words, rows, vocab);
  return cudaGetLastError();
}

}  // namespace minillm
