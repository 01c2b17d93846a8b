// Programmatic dependent launch (PDL, sm_90+): let a kernel start while the kernel before it on the stream is
// still finishing, so a launch's fixed costs (grid launch, CTA rasterisation, loads that do not depend on the
// previous kernel, such as weights) hide behind the previous kernel's tail instead of adding to it.
//
// Contract for every kernel launched with launch_pdl():
//   - it calls pdl_wait() before it reads anything an earlier kernel wrote and before it writes anything an
//     earlier kernel may still read (activations, workspaces, the KV cache); only data nobody writes during
//     the forward (weights, cos/sin tables) may be touched before it;
//   - it may call pdl_trigger() as early as it likes: that only allows the next kernel's CTAs to become
//     resident (they then wait in their own pdl_wait()), it publishes nothing.
// pdl_wait() returns once every earlier kernel of the stream has completed and its writes are visible. In a
// kernel launched without the attribute (older GPUs, MINILLM_PDL=0), both are no-ops. Stream capture records
// the launches as programmatic edges, so CUDA graphs keep the overlap.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

namespace minillm {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

namespace pdl_detail {
// PDL needs sm_90; MINILLM_PDL=0 turns it off (for A/B timings and as an escape hatch). Read per call from a
// cached device query: cheap next to a launch.
inline bool enabled_on_current_device() {
  static const bool env_on = [] {
    const char* v = std::getenv("MINILLM_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  if (!env_on) return false;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  static int major_of[64] = {0};  // 0 = not asked yet
  if (dev < 0 || dev >= 64) return false;
  if (major_of[dev] == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
    major_of[dev] = major;
  }
  return major_of[dev] >= 9;
}
}  // namespace pdl_detail

// kernel<<<grid, block, smem, stream>>>(args...), with the programmatic-serialization attribute when PDL is on.
// Returns the launch's error code.
template <typename... KArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  if (pdl_detail::enabled_on_current_device()) {
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace minillm
