// L2 prefetch of weights a later kernel will read: `cp.async.bulk.prefetch.L2` (sm_90) of whole tensors in
// 32 KB pieces spread over the grid, one piece per thread. Fire and forget: the kernel ends once the requests are
// issued and the bytes land in L2 while the kernels queued behind it run. Decode-sized GEMMs are latency-bound
// (5-7 us for 4-12 MB that HBM delivers in 1-3 us); a product whose weights already sit in L2 is not.
// On sm_80 the kernel does nothing (a hint, never needed for correctness).
#include "common.cuh"
#include "prefetch.h"

namespace minillm {
namespace {

constexpr int64_t kPiece = 32 << 10;

__global__ void l2_prefetch_kernel(L2PrefetchList list) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nth = int64_t(gridDim.x) * blockDim.x;
  int64_t base = 0;  // pieces of the tensors before this one
  for (int t = 0; t < list.count; ++t) {
    const int64_t bytes = list.bytes[t] & ~int64_t(15);  // bulk sizes are multiples of 16
    const int64_t pieces = (bytes + kPiece - 1) / kPiece;
    // This thread's first piece of tensor t in the global numbering base..base+pieces.
    int64_t p = ((tid - base) % nth + nth) % nth;
    for (; p < pieces; p += nth) {
      const int64_t off = p * kPiece;
      const uint32_t size = uint32_t(bytes - off < kPiece ? bytes - off : kPiece);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(list.ptr[t] + off), "r"(size) : "memory");
    }
    base += pieces;
  }
#endif
}

}  // namespace

int l2_prefetch_grid(const L2PrefetchList& list, int num_sms) {
  int64_t pieces = 0;
  for (int t = 0; t < list.count; ++t) pieces += (list.bytes[t] + kPiece - 1) / kPiece;
  // A few pieces per CTA: every SM's copy engine takes a share, none waits behind a long queue.
  const int64_t ctas = (pieces + 3) / 4;
  return int(ctas < 1 ? 1 : (ctas > num_sms ? num_sms : ctas));
}

cudaError_t launch_l2_prefetch(const L2PrefetchList& list, int num_sms, cudaStream_t stream) {
  if (list.count < 0 || list.count > kMaxPrefetchTensors) return cudaErrorInvalidValue;
  for (int t = 0; t < list.count; ++t)
    if (reinterpret_cast<uintptr_t>(list.ptr[t]) % 16 != 0 || list.bytes[t] < 0) return cudaErrorInvalidValue;
  if (list.count == 0) return cudaSuccess;
  const int grid = l2_prefetch_grid(list, num_sms);
  l2_prefetch_kernel<<<grid, 32, 0, stream>>>(list);
  return cudaGetLastError();
}

}  // namespace minillm
