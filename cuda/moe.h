// Plain C++ launchers of the mixture-of-experts kernels (moe_routing.cu, moe_gemm.cu). No torch types:
// moe_bindings.cpp turns tensors into these arguments, and minillm/ops/moe_ops.py mirrors the limits below in
// COVERAGE and fused_shape_reason().
//
// The decode path of one MoE layer is five launches (routing: two), all with fixed-size outputs and no host sync (graph-safe):
//   route    logits [T, E] fp32 -> top-k ids and weights, per-expert counts / offsets, the expert-sorted order of
//            the T*k (token, slot) pairs, and the list of experts that have rows
//   gate_up  act[p] = silu(x[token(p)] Wg_e^T) * (x[token(p)] Wu_e^T) for each sorted pair p of expert e
//   down     pairs[q] = weight[q] * (act[p] Wd_e^T) in fp32, q = order[p] the pair's (token, slot) index
//   combine  y[t] = sum over slots s = 0..k-1 of pairs[t * k + s], in that order (no atomics: deterministic)
// For a few tokens (minillm/ops/moe_ops.py's moe_variant decides) routing takes the router GEMV in, from the
// activations (route_gemv, one launch), and down takes combine in (down_combine): three launches in all.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "dtype.h"

namespace minillm {

constexpr int kMoeMaxExperts = 512;  // routing: E / 32 logits per lane held in registers (16 at most)
constexpr int kMoeMaxTopK = 8;
constexpr int kMoeTileK = 32;        // K per register block: hidden and moe_intermediate must be multiples
constexpr int kMoeKWarps = 4;        // warps along K per CTA: K / kMoeTileK must be at least this
constexpr int kMoeGateCols = 16;     // gate_up: gate (and up) columns per CTA: moe_intermediate must be a multiple
constexpr int kMoeDownCols = 32;     // down: output columns per CTA: hidden must be a multiple
constexpr int kMoeRouteGemvTokens = 16;  // route_gemv: most tokens (an fp32 accumulator per token per thread)
constexpr int kMoeDownCombineCols = 16;  // down_combine: output columns per CTA: hidden must be a multiple

// logits [T, E] fp32, row stride ld_logits. Writes ids [T, k] int32, weights [T, k] fp32 (softmax over the E
// logits, top-k, divided by their sum when renormalize), counts [E], offsets [E + 1] (exclusive, offsets[E] =
// T * k), order [T * k] (pair index t * k + s, grouped by expert ascending, pairs of one expert in pair order:
// a stable sort), active [E + 1] (active[E] = how many experts have rows, active[0..] their ids ascending).
// Top-k order: larger logit first, equal logits by lower expert index. Two launches (top-k grid, grouping
// CTA). 1 <= k <= min(E,
// kMoeMaxTopK), 1 <= E <= kMoeMaxExperts, T >= 0. Returns cudaErrorInvalidValue outside these limits.
cudaError_t launch_moe_route(const float* logits, int64_t ld_logits, int T, int E, int k, bool renormalize,
                             int32_t* ids, float* weights, int32_t* counts, int32_t* offsets, int32_t* order,
                             int32_t* active, cudaStream_t stream);

// launch_moe_route's outputs, from x [T, H] bf16 / fp16 (row stride ldx) and the router weight [E, H] fp32
// (contiguous) instead of logits: logits [T, E] fp32 (contiguous) = x w^T, each product and sum in fp32. counter: a
// device word that is 0 before the launch and is 0 again after it (the last CTA's ticket wraps it); launches that
// share one must not run concurrently. One launch of E CTAs. T <= kMoeRouteGemvTokens, H % 4 == 0, ldx % 4 == 0,
// x 8-byte and router 16-byte aligned; the same E and k limits as launch_moe_route.
cudaError_t launch_moe_route_gemv(const void* x, int64_t ldx, const float* router, int T, int E, int H, int k,
                                  bool renormalize, float* logits, int32_t* ids, float* weights, int32_t* counts,
                                  int32_t* offsets, int32_t* order, int32_t* active, unsigned* counter,
                                  ScalarType dtype, cudaStream_t stream);

// act [T * k, I] (row p: the p-th pair in expert order) from x [T, H] (row stride ldx) and w13 [E, 2I, H]
// (expert e: I gate rows, then I up rows). Only experts listed in active are read. H % kMoeTileK == 0,
// H / kMoeTileK >= kMoeKWarps, I % kMoeGateCols == 0, ldx % 8 == 0, x and w13 16-byte aligned. bf16 / fp16.
cudaError_t launch_moe_gate_up(const void* x, int64_t ldx, const void* w13, const int32_t* order,
                               const int32_t* offsets, const int32_t* active, int T, int k, int E, int H, int I,
                               void* act, ScalarType dtype, cudaStream_t stream);

// pairs [T * k, H] fp32: pairs[order[p]] = weights[order[p]] * act[p] w2[e]^T for the pairs p of each active
// expert e; w2 [E, H, I]. I % kMoeTileK == 0, I / kMoeTileK >= kMoeKWarps, H % kMoeDownCols == 0, act and w2
// 16-byte aligned. bf16 / fp16.
cudaError_t launch_moe_down(const void* act, const void* w2, const float* weights, const int32_t* order,
                            const int32_t* offsets, const int32_t* active, int T, int k, int E, int H, int I,
                            float* pairs, ScalarType dtype, cudaStream_t stream);

// down and combine in one launch: y [T, H] (row stride ldy) = sum over slots s = 0..k-1, in that order, of
// weights[t * k + s] * act[p] w2[ids[t * k + s]]^T in fp32, p the pair's row in act (order[p] = t * k + s). A CTA
// per (token, kMoeDownCombineCols columns) reads the weights of that token's experts: each expert once per token
// that picked it, so it suits a few tokens. No atomics: deterministic. I % 8 == 0, H % kMoeDownCombineCols == 0,
// act and w2 16-byte aligned, ldy even, y 4-byte aligned. bf16 / fp16.
cudaError_t launch_moe_down_combine(const void* act, const void* w2, const int32_t* ids, const float* weights,
                                    const int32_t* order, int T, int k, int E, int H, int I, void* y, int64_t ldy,
                                    ScalarType dtype, cudaStream_t stream);

// y [T, H] (row stride ldy) = the fixed-order sum of each token's k rows of pairs. H % 4 == 0.
cudaError_t launch_moe_combine(const float* pairs, int T, int k, int H, void* y, int64_t ldy, ScalarType dtype,
                               cudaStream_t stream);

}  // namespace minillm
