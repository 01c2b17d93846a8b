// QKV split + per-head q/k RMSNorm (Qwen3) + neox RoPE, one pass: each head is read once and written once.
//
// A head of D elements belongs to `tph` threads (a power of two <= 32, so heads never straddle a warp); each
// thread holds K pairs of vectors (elements [i, i+VEC) and [D/2 + i, D/2 + i + VEC)), exactly the pairs the
// rotate-half RoPE mixes, so no data moves between threads except the norm's sum of squares. Heads of the
// packed row are numbered q (Hq), k (Hkv), v (Hkv); v heads are only copied.
// With the KV caches given, k and v heads are stored straight into their cache slots (the fused kv_write, see
// fused.h): no separate k/v buffers, one launch less per layer, and k/v make one trip through memory.
// Variants: dtype (fp32, fp16, bf16) x access width (16-byte vectors; scalars when unaligned) x K (1, 2, 4)
// x with/without the q/k norm. Rounding follows minillm/ops/fused_ops.py: the normed head is rounded to the
// activation dtype, RoPE runs in fp32 on it (products rounded separately, no FMA) and is rounded once.
// An fp8 cache (CF, kv_fp8.cuh) gets k/v heads rounded to the activation dtype, multiplied by 1 / scale and
// quantized, the bits kv_write_fp8 would store from the unfused k/v; CF = kCacheNative is the code above, unchanged.
// Compile-only check: nvcc -c -gencode arch=compute_90a,code=sm_90a -Xptxas -v cuda/fused_rope.cu
#include <cmath>
#include <type_traits>

#include "fused.h"
#include "kv_fp8.cuh"
#include "launch.h"

namespace minillm {
namespace {
using namespace fused_detail;

constexpr int kCtaThreads = 128;

template <int N>
__device__ __forceinline__ void load_f32(const float* p, float (&out)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 f = *reinterpret_cast<const float4*>(p + i);
      out[i] = f.x, out[i + 1] = f.y, out[i + 2] = f.z, out[i + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = p[i];
  }
}

// Normalises the head held in lo/hi (this thread's pairs; `valid` marks pairs inside the head) in place when
// `apply`; every lane runs the reduction regardless, because its shuffles span the whole warp.
template <typename T, int VEC, int K>
__device__ __forceinline__ void norm_head(float (&lo)[K][VEC], float (&hi)[K][VEC], const bool (&valid)[K],
                                          bool apply, const T* w, int lane, int tph, int half, float eps) {
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < K; ++j)
#pragma unroll
    for (int e = 0; e < VEC; ++e) ss += lo[j][e] * lo[j][e] + hi[j][e] * hi[j][e];
  const float inv = rsqrtf(group_sum(ss, tph) / (2 * half) + eps);
  if (!apply) return;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    if (!valid[j]) continue;
    const int c = (lane + j * tph) * VEC;
    float wl[VEC], wh[VEC];
    load_vec<T, VEC>(w + c, wl);
    load_vec<T, VEC>(w + half + c, wh);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      lo[j][e] = to_float(from_float<T>(__fmul_rn(__fmul_rn(lo[j][e], inv), wl[e])));
      hi[j][e] = to_float(from_float<T>(__fmul_rn(__fmul_rn(hi[j][e], inv), wh[e])));
    }
  }
}

// Where the row of `head` (numbered as in the packed qkv row) of a live token goes: its q, k or v buffer row,
// or with the caches given its cache row for k and v heads, null when the token's slot is negative (not stored).
template <typename T>
__device__ __forceinline__ T* head_dst(const QkNormRopeArgs& a, int64_t token, int head) {
  if (head < a.num_heads) return static_cast<T*>(a.q) + (token * a.num_heads + head) * a.head_dim;
  const bool is_k = head < a.num_heads + a.num_kv_heads;
  const int kv_head = head - a.num_heads - (is_k ? 0 : a.num_kv_heads);
  if (a.slot_mapping == nullptr)
    return static_cast<T*>(is_k ? a.k : a.v) + (token * a.num_kv_heads + kv_head) * a.head_dim;
  const int64_t slot = a.slot_mapping[token];
  if (slot < 0) return nullptr;
  return static_cast<T*>(is_k ? a.k_cache : a.v_cache) + (slot * a.num_kv_heads + kv_head) * a.head_dim;
}

// fp8 cache: the byte address of a live token's k or v head in its cache row, null when its slot is negative.
__device__ __forceinline__ uint8_t* cache_dst_fp8(const QkNormRopeArgs& a, int64_t token, int head) {
  const bool is_k = head < a.num_heads + a.num_kv_heads;
  const int kv_head = head - a.num_heads - (is_k ? 0 : a.num_kv_heads);
  const int64_t slot = a.slot_mapping[token];
  if (slot < 0) return nullptr;
  return static_cast<uint8_t*>(is_k ? a.k_cache : a.v_cache) + (slot * a.num_kv_heads + kv_head) * a.head_dim;
}

// N values rounded to T (what the unfused path hands kv_write), times inv, quantized: N bytes in one store.
template <typename T, int N, int CF>
__device__ __forceinline__ void store_fp8(uint8_t* p, const float (&in)[N], float inv) {
  struct alignas(N) Bytes {
    uint8_t b[N];
  } r;
#pragma unroll
  for (int i = 0; i < N; ++i) r.b[i] = quantize_fp8<CF>(to_float(from_float<T>(in[i])) * inv);
  *reinterpret_cast<Bytes*>(p) = r;
}

// tph: threads per head (a power of two, chosen by launch_k).
template <typename T, int VEC, int K, bool NORM, int CF>
__global__ void __launch_bounds__(kCtaThreads) qk_norm_rope_kernel(const QkNormRopeArgs a, int tph) {
  pdl_enter();  // launch.h: before the first access to memory the kernel before it touches
  const int heads = a.num_heads + 2 * a.num_kv_heads;
  const int64_t group = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / tph;
  const int lane = threadIdx.x % tph;
  const int64_t token = group / heads;
  const int head = static_cast<int>(group % heads);
  // Groups past the last token, and k/v heads of a token whose slot is skipped, have no destination: they
  // still run the (warp-wide) norm reduction but load and store nothing.
  const bool live = token < a.num_tokens;
  T* dst = nullptr;
  uint8_t* dst8 = nullptr;  // fp8 cache only: this k/v head's cache row
  if constexpr (CF == kCacheNative) {
    dst = live ? head_dst<T>(a, token, head) : nullptr;
  } else if (live) {
    if (head < a.num_heads)
      dst = head_dst<T>(a, token, head);
    else
      dst8 = cache_dst_fp8(a, token, head);
  }
  const bool has_dst = dst != nullptr || dst8 != nullptr;
  const int half = a.head_dim / 2;
  const T* src = static_cast<const T*>(a.qkv) + token * a.qkv_row_stride + static_cast<int64_t>(head) * a.head_dim;
  float lo[K][VEC], hi[K][VEC];
  bool valid[K];
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const int c = (lane + j * tph) * VEC;
    valid[j] = has_dst && c < half;
    if (valid[j]) {
      load_vec<T, VEC>(src + c, lo[j]);
      load_vec<T, VEC>(src + half + c, hi[j]);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) lo[j][e] = hi[j][e] = 0.f;
    }
  }
  const bool is_v = head >= a.num_heads + a.num_kv_heads;
  if constexpr (NORM) {
    norm_head<T, VEC, K>(lo, hi, valid, !is_v,
                         static_cast<const T*>(head < a.num_heads ? a.q_norm_weight : a.k_norm_weight), lane, tph,
                         half, a.eps);
  }
  const int64_t pos = has_dst ? a.positions[token] : 0;
  float inv = 1.f;
  if constexpr (CF != kCacheNative) {
    if (dst8 != nullptr) {
      const bool is_k = head < a.num_heads + a.num_kv_heads;
      const int kv_head = head - a.num_heads - (is_k ? 0 : a.num_kv_heads);
      inv = 1.f / (is_k ? a.k_scale : a.v_scale)[kv_head];
    }
  }
  const bool pos_ok = pos >= 0 && pos < a.max_positions;
  const float* cs = a.cos_sin + (pos_ok ? pos : 0) * a.head_dim;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    if (!valid[j]) continue;
    const int c = (lane + j * tph) * VEC;
    if (!is_v) {
      float cos_v[VEC], sin_v[VEC];
      load_f32<VEC>(cs + c, cos_v);
      load_f32<VEC>(cs + half + c, sin_v);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float x1 = lo[j][e], x2 = hi[j][e];
        lo[j][e] = pos_ok ? __fsub_rn(__fmul_rn(x1, cos_v[e]), __fmul_rn(x2, sin_v[e])) : NAN;
        hi[j][e] = pos_ok ? __fadd_rn(__fmul_rn(x2, cos_v[e]), __fmul_rn(x1, sin_v[e])) : NAN;
      }
    }
    if constexpr (CF != kCacheNative) {
      if (dst8 != nullptr) {
        store_fp8<T, VEC, CF>(dst8 + c, lo[j], inv);
        store_fp8<T, VEC, CF>(dst8 + half + c, hi[j], inv);
        continue;
      }
    }
    store_vec<T, VEC>(dst + c, lo[j]);
    store_vec<T, VEC>(dst + half + c, hi[j]);
  }
}

template <typename T, int VEC, int K, int CF = kCacheNative>
cudaError_t launch_k(const QkNormRopeArgs& a, bool norm, cudaStream_t stream) {
  const int pairs = a.head_dim / 2 / VEC;
  if constexpr (K < 4) {
    if (pairs > 32 * K) return launch_k<T, VEC, K * 2, CF>(a, norm, stream);
  }
  if (pairs > 32 * K) return cudaErrorInvalidValue;
  const int tph = next_pow2((pairs + K - 1) / K);
  const int64_t groups = a.num_tokens * (a.num_heads + 2 * a.num_kv_heads);
  const int64_t grid = (groups * tph + kCtaThreads - 1) / kCtaThreads;
  return launch_kernel(norm ? qk_norm_rope_kernel<T, VEC, K, true, CF> : qk_norm_rope_kernel<T, VEC, K, false, CF>,
                       dim3(grid), dim3(kCtaThreads), 0, stream, a, tph);
}

// The cache format of a launch: native without scales, else the fp8 the caches hold (-1: not allowed).
int rope_cache_format(const QkNormRopeArgs& p, ScalarType dtype) {
  if (p.k_scale == nullptr && p.v_scale == nullptr) return kCacheNative;
  const bool ok = p.k_scale != nullptr && p.v_scale != nullptr && p.slot_mapping != nullptr &&
                  dtype != ScalarType::kFloat32;
  return ok ? cache_format_of(p.cache_dtype, dtype) : -1;
}

}  // namespace

cudaError_t launch_qk_norm_rope(const QkNormRopeArgs& p, ScalarType dtype, cudaStream_t stream) {
  const bool norm = p.q_norm_weight != nullptr;
  const bool to_cache = p.slot_mapping != nullptr;
  const bool outputs_ok = to_cache ? p.k_cache != nullptr && p.v_cache != nullptr
                                   : p.k_cache == nullptr && p.v_cache == nullptr && p.k != nullptr && p.v != nullptr;
  if (p.num_tokens < 0 || p.num_heads <= 0 || p.num_kv_heads <= 0 || p.head_dim <= 0 || p.head_dim % 2 != 0 ||
      p.head_dim > kMaxHeadDim || norm != (p.k_norm_weight != nullptr) || p.max_positions <= 0 || !outputs_ok) {
    return cudaErrorInvalidValue;
  }
  const int cf = rope_cache_format(p, dtype);
  if (cf < 0 || (cf != kCacheNative && p.k_scale == nullptr)) return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    // cos/sin are read as float4 in the vector path, so their rows must be 16-byte aligned as well. Cache rows
    // start at multiples of head_dim, so aligned cache bases keep every row aligned.
    const bool vec = vector_width<T>({p.qkv, p.q_norm_weight, p.k_norm_weight, p.q, p.k, p.v, p.cos_sin,
                                      p.k_cache, p.v_cache},
                                     {p.qkv_row_stride, p.head_dim / 2}) == kVec &&
                     p.head_dim % 4 == 0;
    if constexpr (!std::is_same_v<T, float>) {
      if (cf == kCacheE4M3)
        return vec ? launch_k<T, kVec, 1, kCacheE4M3>(p, norm, stream) : launch_k<T, 1, 1, kCacheE4M3>(p, norm, stream);
      if (cf == kCacheE5M2)
        return vec ? launch_k<T, kVec, 1, kCacheE5M2>(p, norm, stream) : launch_k<T, 1, 1, kCacheE5M2>(p, norm, stream);
    }
    return vec ? launch_k<T, kVec, 1>(p, norm, stream) : launch_k<T, 1, 1>(p, norm, stream);
  });
}

}  // namespace minillm
