// Plain C++ launcher of the L2 weight prefetch (cuda/l2_prefetch.cu); fused_bindings.cpp turns tensors into
// this list. Returns cudaSuccess, cudaErrorInvalidValue for a misaligned or oversized list, or the launch error.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace minillm {

constexpr int kMaxPrefetchTensors = 8;

struct L2PrefetchList {
  const char* ptr[kMaxPrefetchTensors];
  int64_t bytes[kMaxPrefetchTensors];
  int count;
};

// CTAs of 32 threads the launch uses: one 32 KB piece per thread, at most 4 per CTA, at most one CTA per SM.
int l2_prefetch_grid(const L2PrefetchList& list, int num_sms);

cudaError_t launch_l2_prefetch(const L2PrefetchList& list, int num_sms, cudaStream_t stream);

}  // namespace minillm
