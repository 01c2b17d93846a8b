// One-pass sampler: temperature + exponential race (Gumbel-max) + argmax, one CTA per row of logits.
//
// token = argmax_c(logit_c / T - log(E_c)) with E_c ~ Exp(1) is a draw from softmax(logits / T): each column
// is read once, its noise made on the fly, and no probabilities are ever written. Rows with inverse
// temperature 0 take the plain argmax (no noise). Ties go to the lowest column and NaN counts as the largest
// value, as in torch.argmax.
// Noise: Philox4x32-10 (the counter-based generator of Salmon et al., 2011, the one curand's
// curand_Philox4x32_10 computes) written out here because curand's headers are not part of every CUDA
// toolkit install this source must compile on. Key = seed (low word, high word); counter = (column / 4,
// row, offset low, offset high); column c uses output word c % 4. So a draw depends only on (seed, row,
// offset, column): the torch reference in minillm/ops/sampling_ops.py recomputes the same 32-bit words.
// Word x -> u = float(x) * 2^-32 + 2^-33 (fp32) in (0, 1]; E = -log1p(-u), so a small E (a likely winner)
// keeps full relative precision; u == 1 gives E = inf, a column that cannot win.
// Logits may be fp32, fp16 or bf16 (the lm_head output as it is, no fp32 copy); each is widened to fp32
// exactly, so the score of a column is the same fp32 number whichever of them holds the same value.
// Columns that provably cannot beat their thread's best so far skip the exact noise (and whole groups of four
// skip Philox): the same winner for a fraction of the logarithms (group_cannot_win, column_cannot_win).
// Variants: 16-byte loads (4 fp32 or 8 half-precision columns; vocab and row stride multiples of that,
// aligned) or scalar loads.
// Compile-only check: nvcc -c -gencode arch=compute_90a,code=sm_90a -Xptxas -v minillm/cuda/sampling.cu
#include <cmath>

#include "fused.h"

namespace minillm {
namespace {

constexpr int kThreads = 1024;

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k.x += 0x9E3779B9u;
      k.y += 0xBB67AE85u;
    }
    const uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
  }
  return c;
}

// u in (0, 1] from one 32-bit word; same fp32 steps as the torch reference.
__device__ __forceinline__ float unit_from_word(uint32_t x) {
  return __fadd_rn(__fmul_rn(__uint2float_rn(x), 2.3283064365386963e-10f), 1.1641532182693481e-10f);
}

// -log(E) for E ~ Exp(1) made from one 32-bit word; same fp32 steps as the torch reference.
__device__ __forceinline__ float neg_log_exponential(uint32_t x) { return -logf(-log1pf(-unit_from_word(x))); }

struct Best {
  float v;
  int i;
};

// True when (v, i) beats b: larger value, NaN above all, lower index on ties.
__device__ __forceinline__ bool beats(float v, int i, const Best& b) {
  if (isnan(v)) return !isnan(b.v) || i < b.i;
  if (isnan(b.v)) return false;
  return v > b.v || (v == b.v && i < b.i);
}

__device__ __forceinline__ Best block_argmax(Best b) {
  __shared__ Best red[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, b.v, o);
    const int i = __shfl_xor_sync(0xffffffffu, b.i, o);
    if (beats(v, i, b)) b = {v, i};
  }
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if ((threadIdx.x & 31) == 0) red[warp] = b;
  __syncthreads();
  if (warp == 0) {
    b = threadIdx.x < warps ? red[threadIdx.x] : Best{-INFINITY, INT32_MAX};
    for (int o = 16; o > 0; o >>= 1) {
      const float v = __shfl_xor_sync(0xffffffffu, b.v, o);
      const int i = __shfl_xor_sync(0xffffffffu, b.i, o);
      if (beats(v, i, b)) b = {v, i};
    }
  }
  return b;
}

// The score of a column on a sampled row: l * inv_t + (-log E), each step rounded to fp32 (a greedy row's
// score is l itself).
__device__ __forceinline__ float race_score(float l, float inv_t, uint32_t word) {
  return __fadd_rn(__fmul_rn(l, inv_t), neg_log_exponential(word));
}

// Pruning (sampled rows): most columns cannot beat the thread's best so far, and proving that is cheaper than
// the two accurate logarithms of their noise. Both tests below only skip a column whose exact score is
// certainly below the best, so the winner (ties and NaN included) is the one the full race picks.
// u >= 2^-33, so E = -log1p(-u) >= u >= 2^-33 and the noise -log(E) <= 33 ln 2 < kMaxNoise, for every column.
constexpr float kMaxNoise = 22.9f;
// Margin for fp32 rounding (products, log1pf / logf within 2 ulp) and for __logf's approximation error:
// orders of magnitude above those errors, orders below the gaps that prune.
__device__ __forceinline__ float slack(float v) { return 1e-3f + 1e-4f * fabsf(v); }

// True when no column of a Philox group, whose largest scaled logit is xmax (NaN if any is NaN), can win.
__device__ __forceinline__ bool group_cannot_win(float xmax, const Best& best) {
  return xmax + kMaxNoise + slack(xmax) < best.v;  // false for NaN
}

// True when the column with scaled logit x and noise word `word` cannot win: E >= u gives -log(E) <= -log(u),
// which the fast __logf bounds up to its error.
__device__ __forceinline__ bool column_cannot_win(float x, uint32_t word, const Best& best) {
  const float noise_bound = -__logf(unit_from_word(word));
  return x + noise_bound + slack(noise_bound) + slack(x) < best.v;
}

// T: logit element type (float, __half or __nv_bfloat16), widened to fp32 exactly before any arithmetic.
// VEC: 16-byte loads of 16 / sizeof(T) columns per thread and iteration (vocab and row stride multiples of
// that, row pointers 16-byte aligned), i.e. one Philox group of 4 columns for fp32, two for 2-byte types; the
// noise of column c stays word c % 4 of group c / 4 either way. Otherwise one group of 4 scalar loads.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads)
    exponential_race_kernel(const T* __restrict__ logits, int64_t row_stride,
                            const float* __restrict__ inv_temperature, int64_t* __restrict__ out, int vocab,
                            uint2 key, uint32_t offset_lo, uint32_t offset_hi) {
  constexpr int kCols = VEC ? 16 / static_cast<int>(sizeof(T)) : 4;  // columns per thread and iteration
  constexpr int kGroups = kCols / 4;                                   // Philox calls per iteration
  const uint32_t row = blockIdx.x;
  const T* x = logits + row * row_stride;
  const float inv_t = inv_temperature[row];
  const bool greedy = inv_t == 0.f;
  // Index `vocab` is past every column: any real column, even at -inf, beats this start on the tie rule.
  Best best{-INFINITY, vocab};
  const int chunks = (vocab + kCols - 1) / kCols;
  for (int k = threadIdx.x; k < chunks; k += blockDim.x) {
    float l[kCols];
    if constexpr (VEC) {
      fused_detail::load_vec<T, kCols>(x + kCols * k, l);
    } else {
#pragma unroll
      for (int e = 0; e < kCols; ++e) {
        l[e] = kCols * k + e < vocab ? fused_detail::to_float(x[kCols * k + e]) : -INFINITY;
      }
    }
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      const int g = kGroups * k + j;
      if (greedy) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 4 * g + e;
          if (!VEC && col >= vocab) break;
          if (beats(l[4 * j + e], col, best)) best = {l[4 * j + e], col};
        }
        continue;
      }
      float xmax = -INFINITY;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float xe = __fmul_rn(l[4 * j + e], inv_t);
        xmax = (xe > xmax || isnan(xe)) ? xe : xmax;
      }
      if (group_cannot_win(xmax, best)) continue;
      const uint4 r = philox4x32_10(make_uint4(static_cast<uint32_t>(g), row, offset_lo, offset_hi), key);
      const uint32_t words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 4 * g + e;
        if (!VEC && col >= vocab) break;
        if (column_cannot_win(__fmul_rn(l[4 * j + e], inv_t), words[e], best)) continue;
        const float s = race_score(l[4 * j + e], inv_t, words[e]);
        if (beats(s, col, best)) best = {s, col};
      }
    }
  }
  best = block_argmax(best);
  if (threadIdx.x == 0) out[row] = best.i;
}

template <typename T>
cudaError_t launch_race(const T* logits, int64_t row_stride, const float* inv_temperature, int64_t* out,
                        int64_t rows, int64_t vocab, uint2 key, uint32_t lo, uint32_t hi, cudaStream_t stream) {
  constexpr int kVecCols = 16 / static_cast<int>(sizeof(T));
  const bool vec = vocab % kVecCols == 0 && row_stride % kVecCols == 0 &&
                   reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  const int64_t chunks = vec ? vocab / kVecCols : (vocab + 3) / 4;
  const int threads = chunks >= kThreads ? kThreads : static_cast<int>((chunks + 31) / 32 * 32);
  if (vec) {
    exponential_race_kernel<T, true><<<rows, threads, 0, stream>>>(logits, row_stride, inv_temperature, out,
                                                                    static_cast<int>(vocab), key, lo, hi);
  } else {
    exponential_race_kernel<T, false><<<rows, threads, 0, stream>>>(logits, row_stride, inv_temperature, out,
                                                                     static_cast<int>(vocab), key, lo, hi);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_sample_exponential_race(const void* logits, int64_t row_stride, const float* inv_temperature,
                                           int64_t* out, int64_t rows, int64_t vocab, uint64_t seed,
                                           uint64_t offset, ScalarType logits_dtype, cudaStream_t stream) {
  if (rows < 0 || rows > INT32_MAX || vocab <= 0 || vocab > kMaxVocab - 4) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const uint2 key = make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const uint32_t lo = static_cast<uint32_t>(offset), hi = static_cast<uint32_t>(offset >> 32);
  return fused_detail::dispatch_dtype(logits_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_race(static_cast<const T*>(logits), row_stride, inv_temperature, out, rows, vocab, key, lo, hi,
                       stream);
  });
}

}  // namespace minillm
