// Plain C++ launcher of the small-M GEMM (cuda/small_m_gemm.cu): Y[M, N] = X[M, K] @ W[N, K]^T (+ bias[N]),
// bf16 or fp16 in and out, fp32 accumulation, for decode-sized M (1 .. kSmallMMaxM). No torch types here:
// cuda/gemm_bindings.cpp turns tensors into these arguments. Strides are in elements.
//
// Launched with programmatic dependent launch (pdl.cuh): the kernel streams its weight tiles in before it
// waits for the previous kernel, and reads X / writes Y only after. Weights must therefore not be written by the
// kernels just before it on the stream (they never are during a forward pass).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace minillm {

constexpr int kSmallMMaxM = 256;    // largest M (tokens) the kernel takes
constexpr int kSmallMTileN = 64;    // N must be a multiple of this (weight rows per CTA)
constexpr int kSmallMTileK = 64;    // K must be a multiple of this (k-depth of one pipeline stage)
constexpr int kSmallMMaxSplit = 16; // most K-splits of one output tile

enum class GemmDType : int { kBF16 = 0, kFP16 = 1 };

struct SmallMGemmArgs {
  const void* x;         // [m, k], rows x_row_stride elements apart (a multiple of 8), 16-byte aligned
  int64_t x_row_stride;
  const void* weight;    // [n, k] contiguous, 16-byte aligned
  const void* bias;      // [n] or nullptr (added in fp32 before rounding)
  void* y;               // [m, n] contiguous, 16-byte aligned
  int m, n, k;
  GemmDType dtype;
};

// What one launch looks like; from host-side sizes only, so a CUDA graph replays the same grid and workspace.
struct SmallMGemmPlan {
  int tile_m;               // tokens per CTA: 64, 128 or 256 (kernel variant)
  int split_k;              // CTAs sharing one output tile along K (1 = no workspace, no counters)
  int grid_x, grid_y, grid_z;  // N tiles, M tiles, K splits
  int x_rows;               // token rows of one activation stage in shared memory: min(tile_m, m rounded to 16)
  int smem_bytes;           // dynamic shared memory per CTA
  int64_t workspace_floats; // fp32 workspace the launch needs (0 without split-K)
  int64_t counters;         // int32 tile counters the launch needs (0 without split-K)
};

// tile_m / split_k = 0: the heuristic picks (see the cost model in small_m_gemm.cu); otherwise forced (tile_m
// 64/128/256, split_k clamped to [1, min(k / 64, kSmallMMaxSplit)]). When the split-K tile counters needed exceed
// num_counters, split_k falls back to 1. m, n, k must satisfy the launcher's rules (not checked here).
SmallMGemmPlan plan_small_m_gemm(int m, int n, int k, int num_sms, int64_t num_counters, int tile_m = 0,
                                 int split_k = 0);

// workspace: plan.workspace_floats fp32 (any contents); counters: plan.counters int32, all zero on entry, and
// left all zero again by the launch (the last CTA of each tile resets its counter). Two launches sharing
// counters must not run concurrently (different streams). Returns cudaErrorInvalidValue when m is outside
// [1, kSmallMMaxM], n or k is not a positive multiple of 64, or a pointer/stride is misaligned; else the launch
// error.
cudaError_t launch_small_m_gemm(const SmallMGemmArgs& a, const SmallMGemmPlan& plan, float* workspace,
                                int* counters, cudaStream_t stream);

}  // namespace minillm
