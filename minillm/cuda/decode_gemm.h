// Plain C++ launcher of the decode GEMM (decode_gemm.cu). No torch types: decode_gemm_bindings.cpp turns tensors
// into these arguments, and minillm/ops/decode_gemm.py mirrors the limits below in covers().
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "dtype.h"

namespace minillm {

constexpr int kDecodeGemmTileK = 64;     // K per ring stage: K must be a multiple
constexpr int kDecodeGemmAlignN = 128;   // N must be a multiple (the widest weight-row tile)
constexpr int kDecodeGemmMaxRows = 256;  // M beyond this is not a decode batch: cuBLAS
constexpr int kDecodeGemmMaxSplits = 8;  // the portable thread-block-cluster size

// y[M, N] = x[M, K] * w[N, K]^T, fp32 accumulation, bf16/fp16 in and out. Rows of x, w and y contiguous; row
// strides in elements, multiples of 8 (x, w: 16-byte rows for the bulk copies) and 4 (y). x, w 16-byte aligned.
// K is split into `splits` (1..kDecodeGemmMaxSplits, at most K / kDecodeGemmTileK) contiguous ranges computed by
// the CTAs of one thread-block cluster and summed through distributed shared memory. Needs sm_90 (clusters, bulk
// async copies, mbarrier transaction counts). Returns cudaErrorInvalidValue for arguments outside these limits.
cudaError_t launch_decode_gemm(const void* x, int64_t ldx, const void* w, int64_t ldw, void* y, int64_t ldy, int M,
                               int N, int K, int splits, ScalarType dtype, cudaStream_t stream);

}  // namespace minillm
