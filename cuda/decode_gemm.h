// Plain C++ launcher of the decode GEMM (decode_gemm.cu). No torch types: decode_gemm_bindings.cpp turns tensors
// into these arguments, and minillm/ops/decode_gemm.py mirrors the limits below in covers().
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "dtype.h"

namespace minillm {

constexpr int kDecodeGemmTileK = 32;     // K per register block (16 bytes per lane and row): K must be a multiple
constexpr int kDecodeGemmAlignN = 128;   // N must be a multiple (the widest CTA: 8 warps x 16 weight rows)
constexpr int kDecodeGemmMaxRows = 64;   // M beyond this: cuBLAS (the fragments hold at most 8 n8 tiles of x)
constexpr int kDecodeGemmMaxSplits = 8;  // the portable thread-block-cluster size
constexpr int kDecodeGemmWarps = 8;      // warps per CTA: row_warps x (8 / row_warps) along K

// True when (splits, row_warps) is a legal configuration for this K: row_warps in {1, 2, 4, 8}, splits in
// [1, kDecodeGemmMaxSplits], and every warp gets at least one k32 block (splits * 8 / row_warps <= K / 32).
bool decode_gemm_config_ok(int K, int splits, int row_warps);

// y[M, N] = x[M, K] * w[N, K]^T, fp32 accumulation, bf16/fp16 in and out, M <= kDecodeGemmMaxRows. Rows of x, w
// and y contiguous; row strides in elements, multiples of 8 (x, w: 16-byte loads) and 4 (y). x, w 16-byte
// aligned. A CTA covers 16 * row_warps weight rows; K is split over its 8 / row_warps warps along K and over
// `splits` CTAs of one thread-block cluster (summed through distributed shared memory). Needs sm_90. Returns
// cudaErrorInvalidValue for arguments outside these limits.
cudaError_t launch_decode_gemm(const void* x, int64_t ldx, const void* w, int64_t ldw, void* y, int64_t ldy, int M,
                               int N, int K, int splits, int row_warps, ScalarType dtype, cudaStream_t stream);

}  // namespace minillm
