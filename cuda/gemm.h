// Plain C++ launcher of the skinny GEMM (decode-sized linear layers). No torch types: cuda/fused_bindings.cpp
// turns tensors into these arguments. Returns cudaSuccess, cudaErrorInvalidValue for an unsupported shape, or the
// launch error.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "fused.h"

namespace minillm {

constexpr int kGemmTileN = 128;   // output columns per CTA: N must be a multiple
constexpr int kGemmTileK = 64;    // K per pipeline stage: K must be a multiple of splits * kGemmTileK
constexpr int kGemmMaxSplits = 8;  // the portable thread-block-cluster size

// y[M, N] = x[M, K] * w[N, K]^T (rows of x, w and y contiguous, row strides in elements), fp32 accumulation.
// The K dimension is cut into `splits` pieces computed by the CTAs of one thread-block cluster, whose partial
// tiles are summed through distributed shared memory: a decode-sized M gives too few output tiles to occupy
// the GPU otherwise. Needs sm_90 (clusters); splits in {1, 2, 4, 8}.
cudaError_t launch_skinny_gemm(const void* x, int64_t ldx, const void* w, int64_t ldw, void* y, int64_t ldy, int M,
                               int N, int K, int splits, ScalarType dtype, cudaStream_t stream);

}  // namespace minillm
