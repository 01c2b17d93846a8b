// Kernel launches with programmatic dependent launch (PDL, sm_90+).
//
// A kernel launched with PDL may be scheduled while the kernel before it in the stream is still running, once
// every CTA of that kernel has called pdl_trigger() (or exited). It must call pdl_wait() (below) before it
// touches memory the kernel before it reads or writes: pdl_wait() returns when that grid has finished and its
// writes are visible. Every kernel launched through launch_kernel() does so first thing, so turning PDL on or
// off changes no result, only how much of a kernel's launch overlaps its predecessor's tail.
//
// Whether launches ask for PDL is a per-thread setting: the engine sets it from its execution plan around its own
// launches and graph captures (minillm/ops/launch.py), so direct op calls (tests, check-kernels) launch as plain
// kernels unless they ask. A CUDA graph keeps what was captured. For the .cu files only (device code).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "fused.h"  // set_pdl_launches

namespace minillm {

bool pdl_launches();

// pdl_wait: return once the grid this one may overlap has finished and its writes are visible (at once when the
// kernel was not launched with PDL). pdl_trigger: let the next kernel in the stream be scheduled (it still waits
// in its own pdl_wait for this grid to finish). No-ops before sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Both, first thing in every kernel launched through launch_kernel(): nothing is read or written before the grid
// before it has finished, and the next kernel may be scheduled from then on.
__device__ __forceinline__ void pdl_enter() {
  pdl_wait();
  pdl_trigger();
}

// kernel<<<grid, block, smem, stream>>>(args...), with PDL when this thread asks for it; launch_kernel_with
// adds up to 3 launch attributes of the caller's own (a cluster shape).
template <typename... Params, typename... Args>
cudaError_t launch_kernel_with(const cudaLaunchAttribute* extra, int num_extra, void (*kernel)(Params...),
                               dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attrs[4];
  int n = 0;
  for (; n < num_extra && n < 3; ++n) attrs[n] = extra[n];
  if (pdl_launches()) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          Args&&... args) {
  return launch_kernel_with(nullptr, 0, kernel, grid, block, smem, stream, std::forward<Args>(args)...);
}

}  // namespace minillm
