// Launchers of the fused elementwise kernels and the one-pass sampler (plain C++, no torch types).
//
// Sources: fused_norm.cu (rms_norm, fused_add_rms_norm), fused_act.cu (silu_and_mul), fused_rope.cu
// (qk_norm_rope), sampling.cu (sample_exponential_race, seeded_exponential), sampling_topp.cu
// (truncation_threshold). fused_bindings.cpp turns tensors into these arguments and registers the
// torch.ops.minillm.* ops. Strides and sizes are in elements. Every launcher
// returns the launch's error code (cudaSuccess, or cudaErrorInvalidValue for arguments outside the limits
// below, which the bindings check first with clearer messages).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "dtype.h"

namespace minillm {

// Largest sizes the kernels keep in registers (a row of the norm, a head of qk_norm_rope).
constexpr int64_t kMaxNormHidden = 8192;  // the largest Qwen2/Qwen3 hidden size
constexpr int kMaxHeadDim = 256;
// The sampler indexes columns with 32-bit ints.
constexpr int64_t kMaxVocab = 2147483647;

// Whether this thread's later launches of minillm's kernels ask for programmatic dependent launch (launch.h);
// returns the previous setting. launch.cu.
bool set_pdl_launches(bool on);

// y[t] = x[t] / rms(x[t]) * weight. x rows start x_row_stride elements apart; y is contiguous [rows, hidden].
cudaError_t launch_rms_norm(const void* x, int64_t x_row_stride, const void* weight, void* y, int64_t rows,
                            int64_t hidden, float eps, ScalarType dtype, cudaStream_t stream);

// sum[t] = x[t] + residual[t] rounded to dtype; y[t] = rms_norm(sum[t]) * weight. Reads each input once and
// writes each output once; y and sum are contiguous [rows, hidden].
cudaError_t launch_fused_add_rms_norm(const void* x, int64_t x_row_stride, const void* residual,
                                      int64_t residual_row_stride, const void* weight, void* y, void* sum,
                                      int64_t rows, int64_t hidden, float eps, ScalarType dtype, cudaStream_t stream);

// gate_up rows hold [gate (inter) | up (inter)]; out[t] = silu(gate) * up, contiguous [rows, inter].
cudaError_t launch_silu_and_mul(const void* gate_up, int64_t in_row_stride, void* out, int64_t rows,
                                int64_t inter, ScalarType dtype, cudaStream_t stream);

// Splits qkv rows [(Hq + 2 Hkv) * D] into contiguous q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]; applies the
// per-head RMSNorm to q and k when both weights are non-null, then neox RoPE from cos_sin (fp32
// [max_positions, D]: cos | sin). A position outside [0, max_positions) yields NaN in its q and k rows.
// Fused KV-cache write: with k_cache, v_cache and slot_mapping all non-null, the k and v rows of token t go
// to flat slot slot_mapping[t] of the caches (contiguous [num_blocks, block_size, Hkv, D] of the activation
// dtype; row of kv head h at element (slot * Hkv + h) * D) instead of to k and v, which are then unused and
// may be null; slot < 0 stores nothing for that token (q is still written). The bits stored are those the
// unfused path writes to k/v (and kv_write then copies). Slots must lie inside the caches: unchecked.
// All three null: the unfused behaviour above.
struct QkNormRopeArgs {
  const void* qkv;
  int64_t qkv_row_stride;
  const int64_t* positions;
  const float* cos_sin;
  int64_t max_positions;
  const void* q_norm_weight;  // nullable (Qwen2 has no q/k norm)
  const void* k_norm_weight;  // nullable, together with q_norm_weight
  void* q;
  void* k;  // unused (nullable) when the caches are given
  void* v;
  int64_t num_tokens;
  int num_heads;
  int num_kv_heads;
  int head_dim;  // even, <= kMaxHeadDim
  float eps;
  void* k_cache;                 // nullable, together with v_cache and slot_mapping
  void* v_cache;
  const int64_t* slot_mapping;  // [>= num_tokens]
  // An fp8 cache (kv_fp8.cuh): k/v heads are stored as fp8(round_to_dtype(x) * (1 / scale[kv head])), bit for
  // bit kv_write_fp8 of the unfused k/v. Both scales null: the cache holds the activation dtype.
  const float* k_scale;  // fp32 [num_kv_heads], nullable together with v_scale
  const float* v_scale;
  ScalarType cache_dtype;  // kFloat8E4M3 or kFloat8E5M2 when the scales are given
};
cudaError_t launch_qk_norm_rope(const QkNormRopeArgs& args, ScalarType dtype, cudaStream_t stream);

// out[r] = argmax_c(logits[r, c] * inv_temperature[r] - log(E[r, c])), E ~ Exp(1) drawn by Philox4x32-10
// with key = seed and counter = (c / 4, r, offset low, offset high), word c % 4; rows with
// inv_temperature 0 take the plain argmax. Ties go to the lowest column, NaN counts as largest (torch.argmax).
// logits (fp32, fp16 or bf16 per logits_dtype) are widened to fp32 exactly: a value gives the same token
// whichever of the three holds it.
// splits: CTAs per row, in [1, kMaxRaceSplits] (sample_exponential_race_splits picks it); the launch may use
// fewer, so that none gets an empty column range. The tokens are the same bit for bit for every splits.
// workspace: sample_exponential_race_workspace_bytes(rows, splits) bytes of device memory, any contents (the
// launch zeroes what it needs on `stream`), not used by another launch until this one is done; null when that
// size is 0.
// filter: at most one of
// - threshold: fp32 [rows]; columns whose widened logit is below their row's threshold count as -inf (the masking
//   of top-k / top-p / min-p, launch_truncation_threshold);
// - bitmask: int32 [num_mask_rows, words] (words >= ceil(vocab / 32); bit c % 32 of word c / 32 allows column
//   c, xgrammar's layout) of the rows listed in mask_rows (int64, ascending), or of every row in order when
//   mask_rows is null (num_mask_rows = rows); a column whose bit is clear counts as -inf, rows not listed are
//   not filtered.
struct RaceFilter {
  const float* threshold = nullptr;
  const int32_t* bitmask = nullptr;
  int64_t words = 0;
  const int64_t* mask_rows = nullptr;
  int num_mask_rows = 0;
};
cudaError_t launch_sample_exponential_race(const void* logits, int64_t row_stride, const float* inv_temperature,
                                           const RaceFilter& filter, int64_t* out, int64_t rows, int64_t vocab,
                                           uint64_t seed, uint64_t offset, int splits, void* workspace,
                                           ScalarType logits_dtype, cudaStream_t stream);

// Seeded rows' noise: for i < listed, noise[args[i], c] = E ~ Exp(1) for every column c < vocab, from
// Philox4x32-10 with key = args[listed + i] (the request's seed, as 64 bits) and counter = (c / 4, position low,
// position high, 0x53454544), word c % 4, where position = args[2 * listed + i] + offset (the output token's index);
// E = -log1pf(-u), u = float(word) * 2^-32 + 2^-33. args: int64 [3, listed] on the device; rows outside
// [0, rows) are skipped. listed <= 65535.
cudaError_t launch_seeded_exponential(float* noise, int64_t row_stride, int64_t rows, int64_t vocab,
                                      const int64_t* args, int64_t listed, uint64_t offset, cudaStream_t stream);

// The current device's SM count and compute capability (major), asked once per device (sampling.cu); 0 if the
// query fails.
int current_sm_count();
int current_cc_major();
// Shared memory of an SM, and the most one CTA may opt in to, in bytes (0 if the query fails).
int current_smem_per_sm();
int current_smem_optin();

// Truncation threshold per row (sampling_topp.cu): out[r] = the logit below which top-k / top-p / min-p mask
// row r of fp32 logits (after temperature), with the semantics of the torch reference
// (minillm/ops/sampling_ops.py: truncation_threshold_torch); -inf when nothing is masked. top_k: int64 [rows]
// (< 1 or >= vocab: off); top_p: fp32 [rows] (1: off); log_min_p: fp32 [rows], log(min_p) (-inf: off); each
// nullable (off on every row). The masses are summed in 64-bit fixed point, so vocab <= kMaxThresholdVocab.
// splits: CTAs per row (a cluster, sm_90 only), 0 = the launcher's choice (several only when the rows leave SMs
// idle); rounded down to a power of two <= 8, and 1 off sm_90. The thresholds are the same bit for bit for every
// value (integer sums).
constexpr int64_t kMaxThresholdVocab = 8388608;  // 2^23
cudaError_t launch_truncation_threshold(const float* logits, int64_t row_stride, int64_t rows, int64_t vocab,
                                        const int64_t* top_k, const float* top_p, const float* log_min_p,
                                        float* out, int64_t splits, cudaStream_t stream);

// More CTAs per row would only lengthen the merge of a row's partial results.
constexpr int kMaxRaceSplits = 1024;

// CTAs per row for the sampler: `requested` when > 0 (capped at kMaxRaceSplits), else its own choice from rows,
// vocab and the current device's SM count (1 when the rows alone fill the GPU).
int sample_exponential_race_splits(int64_t rows, int64_t vocab, int64_t requested);

// Device bytes of the workspace of a launch with `splits` CTAs per row: 0 for 1, else a partial result per CTA
// and a ticket per row.
int64_t sample_exponential_race_workspace_bytes(int64_t rows, int splits);

}  // namespace minillm

#if defined(__CUDACC__)
// Helpers shared by the fused kernel sources (nvcc only; the bindings never see them).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <initializer_list>

namespace minillm::fused_detail {

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) with the C++ type of dtype.
template <typename F>
cudaError_t dispatch_dtype(ScalarType dtype, F&& f) {
  switch (dtype) {
    case ScalarType::kFloat32: return f(TypeTag<float>{});
    case ScalarType::kFloat16: return f(TypeTag<__half>{});
    case ScalarType::kBFloat16: return f(TypeTag<__nv_bfloat16>{});
  }
  return cudaErrorInvalidValue;
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// Round-to-nearest-even, as torch's .to(dtype) does.
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// N elements moved as one access: 16 bytes when N * sizeof(T) == 16.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[N]) {
  const Vec<T, N> r = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(r.v[i]);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[N]) {
  Vec<T, N> r;
#pragma unroll
  for (int i = 0; i < N; ++i) r.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Vec<T, N>*>(p) = r;
}

// Sum over aligned groups of `width` lanes (a power of two <= 32). Every lane of the warp must call it.
__device__ __forceinline__ float group_sum(float v, int width) {
  for (int o = width / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Elements per 16-byte access for T when every pointer is 16-byte aligned and every row stride and the
// row length are multiples of it; 1 (scalar accesses) otherwise.
template <typename T>
inline int vector_width(std::initializer_list<const void*> ptrs, std::initializer_list<int64_t> strides) {
  constexpr int kVec = 16 / sizeof(T);
  for (const void* p : ptrs)
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  for (int64_t s : strides)
    if (s % kVec != 0) return 1;
  return kVec;
}

inline int next_pow2(int64_t n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

}  // namespace minillm::fused_detail
#endif  // __CUDACC__
