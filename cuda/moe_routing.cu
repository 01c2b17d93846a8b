// MoE routing: softmax over each token's E router logits (fp32), its top-k, the renormalised weights, then the
// per-expert counts, offsets, the expert-sorted (stable) order of the T*k pairs and the list of experts that have
// rows. Everything the grouped expert GEMMs need, with outputs whose sizes depend only on T (graph-safe: no host
// sync, nothing allocated per launch).
//
// From fp32 logits (launch_moe_route), two launches: the top-k over a grid of warps (a warp per token), then the
// grouping in one CTA, which needs every token's ids (under PDL the second launch overlaps the first one's tail).
// From the activations and the router weight (launch_moe_route_gemv, a few tokens), one launch that replaces
// those two and the router GEMV before them (at decode each is a few microseconds of mostly launch latency): CTA
// e computes expert e's logit of every token, and the last CTA to finish (a ticket counter) runs the same top-k
// and grouping code over all tokens.
//
// Top-k: lane l holds logits l, l + 32, ... (EPL = ceil(E / 32) registers); k rounds of a warp argmax (two
// redux.sync on order-preserving integer keys). Order:
// larger logit first, equal logits by lower expert index (softmax is monotonic, so the top-k of the logits is the
// top-k of the probabilities; choosing on the logits never meets a tie that softmax rounding created).
// torch.topk leaves the order of equal values unspecified (on CPU it is not by index), so on exact ties this is
// a defined choice, not torch's; the probabilities are expf(l - max) / sum as torch.softmax computes them, the
// sums in another order (last-bit differences).
//
// Grouping: counts by shared-memory atomics (a count does not depend on the order of the adds), a warp scan for
// offsets and the active list, then a stable counting sort in chunks of a CTA's threads: within a warp,
// __match_any_sync ranks the lanes that share an expert; per-warp counts in shared memory give the rank across
// the chunk's warps; a running cursor per expert carries it across chunks.
#include <math_constants.h>

#include "common.cuh"
#include "launch.h"
#include "moe.h"

namespace minillm {
namespace {

constexpr int kGroupThreads = 1024;  // the grouping CTA of the two-launch path
constexpr int kTopkWarps = 8;        // tokens per CTA of the top-k grid
constexpr int kGemvThreads = 512, kGemvWarps = kGemvThreads / 32;  // a CTA of the one-launch path

// fp32 -> uint32 with the same order (for redux.sync, which compares integers). -0 is made +0 first, so the two
// zeros are one value, as float comparison has them; NaN never gets here.
__device__ __forceinline__ uint32_t ordered_key(float f) {
  const uint32_t u = __float_as_uint(f + 0.f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// One warp: the top-k of a token's E logits. The row is read through L2 (ld.cg): in the one-launch path other
// CTAs wrote it during this launch, and L1 is not coherent with their stores.
template <int EPL>
__device__ void topk_token(const float* row, int E, int k, bool renormalize, int32_t* ids, float* weights) {
  const int lane = threadIdx.x % 32;
  float v[EPL];
  uint32_t key[EPL];  // 0: not a candidate (chosen already, or past E); every real logit's key is above 0
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    const int e = lane + 32 * j;
    const float l = e < E ? __ldcg(row + e) : -CUDART_INF_F;
    v[j] = l != l ? -CUDART_INF_F : l;  // a NaN logit ranks last, so every chosen id stays a real expert
    key[j] = e < E ? ordered_key(v[j]) : 0u;
  }
  // Each round: the warp's largest key (one redux.sync), then the lowest expert index holding it (another): the
  // lanes scan their experts in ascending order and keep the first of equal keys, so ties go to the lower index.
  float mx = 0.f, sum = 0.f, chosen_sum = 0.f, my_p = 0.f;
  int my_id = 0;
  for (int s = 0; s < k; ++s) {
    uint32_t best = 0;
    int bj = 0;
#pragma unroll
    for (int j = 0; j < EPL; ++j)
      if (key[j] > best) {
        best = key[j];
        bj = j;
      }
    const uint32_t top = __reduce_max_sync(0xffffffffu, best);
    const int id = static_cast<int>(
        __reduce_min_sync(0xffffffffu, best == top ? static_cast<uint32_t>(lane + 32 * bj) : 0xffffffffu));
#pragma unroll
    for (int j = 0; j < EPL; ++j)
      if (lane + 32 * j == id) key[j] = 0u;
    if (s == 0) {  // the largest logit: the softmax's max, then its denominator
      mx = key_value(top);
#pragma unroll
      for (int j = 0; j < EPL; ++j)
        if (lane + 32 * j < E) sum += expf(v[j] - mx);
      sum = warp_sum_xor(sum, 1, 32);
    }
    const float p = expf(key_value(top) - mx) / sum;
    chosen_sum += p;
    if (lane == s) {
      my_p = p;
      my_id = id;
    }
  }
  if (lane < k) {
    ids[lane] = my_id;
    weights[lane] = renormalize ? my_p / chosen_sum : my_p;
  }
}

template <int EPL>
__global__ void __launch_bounds__(32 * kTopkWarps)
    moe_topk_kernel(const float* __restrict__ logits, int64_t ld, int T, int E, int k, bool renormalize,
                    int32_t* __restrict__ ids, float* __restrict__ weights) {
  pdl_enter();
  const int t = blockIdx.x * kTopkWarps + threadIdx.x / 32;
  if (t < T) topk_token<EPL>(logits + t * ld, E, k, renormalize, ids + t * k, weights + t * k);
}

// The grouping's shared memory for a CTA of kThreads threads.
template <int kThreads>
struct GroupSmem {
  int hist[kMoeMaxExperts], cursor[kMoeMaxExperts];
  uint8_t warp_hist[kThreads / 32][kMoeMaxExperts];  // pairs of the chunk per (warp, expert): <= 32
};

// Before group_pairs, and before anything is read (so that it overlaps the previous kernel's tail under PDL).
template <int kThreads>
__device__ __forceinline__ void clear_counts(GroupSmem<kThreads>& s, int E) {
  for (int e = threadIdx.x; e < E; e += kThreads) s.hist[e] = 0;
}

// counts, offsets, order and active of the T * k ids, by the whole CTA; ids must be readable by every thread
// (written before the launch, or by this CTA before a __syncthreads).
template <int kThreads>
__device__ void group_pairs(GroupSmem<kThreads>& s, const int32_t* ids, int T, int E, int k, int32_t* counts,
                            int32_t* offsets, int32_t* order, int32_t* active) {
  constexpr int kWarps = kThreads / 32;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  __syncthreads();
  const int n = T * k;
  for (int i = tid; i < n; i += kThreads) atomicAdd(&s.hist[ids[i]], 1);
  __syncthreads();

  if (warp == 0) {  // exclusive scans of the counts and of the has-rows flags; lane l owns a contiguous run
    const int per = (E + 31) / 32, e0 = lane * per, e1 = min(E, e0 + per);
    int run = 0, run_active = 0;
    for (int e = e0; e < e1; ++e) {
      run += s.hist[e];
      run_active += s.hist[e] > 0;
    }
    int incl = run, incl_active = run_active;
    for (int m = 1; m < 32; m <<= 1) {
      const int a = __shfl_up_sync(0xffffffffu, incl, m), b = __shfl_up_sync(0xffffffffu, incl_active, m);
      if (lane >= m) {
        incl += a;
        incl_active += b;
      }
    }
    int off = incl - run, slot = incl_active - run_active;
    for (int e = e0; e < e1; ++e) {
      const int c = s.hist[e];
      counts[e] = c;
      offsets[e] = off;
      s.cursor[e] = off;
      if (c > 0) active[slot++] = e;
      off += c;
    }
    if (lane == 31) {
      offsets[E] = incl;
      active[E] = incl_active;
    }
  }
  __syncthreads();

  const uint32_t lower = (1u << lane) - 1u;
  for (int base = 0; base < n; base += kThreads) {
    for (int i = tid; i < kWarps * E; i += kThreads) s.warp_hist[i / E][i % E] = 0;
    __syncthreads();
    const int i = base + tid;
    const int e = i < n ? ids[i] : -1;
    const uint32_t same = __match_any_sync(0xffffffffu, e);
    const int rank = __popc(same & lower);
    if (e >= 0 && rank == 0) s.warp_hist[warp][e] = static_cast<uint8_t>(__popc(same));
    __syncthreads();
    if (e >= 0) {
      int before = 0;
      for (int w = 0; w < warp; ++w) before += s.warp_hist[w][e];
      order[s.cursor[e] + before + rank] = i;
    }
    __syncthreads();
    for (int x = tid; x < E; x += kThreads) {
      int add = 0;
      for (int w = 0; w < kWarps; ++w) add += s.warp_hist[w][x];
      s.cursor[x] += add;
    }
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kGroupThreads, 1)
    moe_group_kernel(const int32_t* __restrict__ ids, int T, int E, int k, int32_t* __restrict__ counts,
                     int32_t* __restrict__ offsets, int32_t* __restrict__ order, int32_t* __restrict__ active) {
  __shared__ GroupSmem<kGroupThreads> smem;
  clear_counts(smem, E);
  pdl_enter();  // ids come from the top-k grid
  group_pairs(smem, ids, T, E, k, counts, offsets, order, active);
}

// ---- the one-launch path: router GEMV, then the top-k and the grouping in the last CTA to finish -------------

// logits[t * E + e] = x[t] . w[e] in fp32 for CTA e's expert, every token t < T: the CTA's threads take 4
// columns at a time, then a warp butterfly and the warps in index order (the same sums every run).
template <typename T>
__device__ void router_logits_cta(const T* x, int64_t ldx, const float* w_row, int tokens, int H, float* logits,
                                  int E, float (&red)[kGemvWarps][kMoeRouteGemvTokens]) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  float acc[kMoeRouteGemvTokens];
#pragma unroll
  for (int t = 0; t < kMoeRouteGemvTokens; ++t) acc[t] = 0.f;
  for (int c = 4 * tid; c < H; c += 4 * kGemvThreads) {
    const float4 wv = __ldg(reinterpret_cast<const float4*>(w_row + c));
#pragma unroll
    for (int t = 0; t < kMoeRouteGemvTokens; ++t) {
      if (t < tokens) {
        const uint2 xv = __ldg(reinterpret_cast<const uint2*>(x + t * ldx + c));
        const float2 lo = DType<T>::to_float2(xv.x), hi = DType<T>::to_float2(xv.y);
        acc[t] = fmaf(lo.x, wv.x, acc[t]);
        acc[t] = fmaf(lo.y, wv.y, acc[t]);
        acc[t] = fmaf(hi.x, wv.z, acc[t]);
        acc[t] = fmaf(hi.y, wv.w, acc[t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kMoeRouteGemvTokens; ++t) {
    if (t < tokens) {
      const float v = warp_sum_xor(acc[t], 1, 32);
      if (lane == 0) red[warp][t] = v;
    }
  }
  __syncthreads();
  if (tid < tokens) {
    float v = red[0][tid];
    for (int q = 1; q < kGemvWarps; ++q) v += red[q][tid];
    logits[static_cast<int64_t>(tid) * E + blockIdx.x] = v;
  }
}

// Whether this CTA is the last of the grid to get here; every CTA's earlier global stores are then visible to
// it. atomicInc wraps the counter back to 0 on the last ticket, so it is 0 again for the next launch (a graph
// replays the same counter).
__device__ bool last_cta(unsigned* counter, bool* flag) {
  __threadfence();  // this CTA's stores before its ticket
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned ticket = atomicInc(counter, gridDim.x - 1);
    __threadfence();  // and the other CTAs' stores before the last one reads them
    *flag = ticket == gridDim.x - 1;
  }
  __syncthreads();
  return *flag;
}

template <typename T, int EPL>
__global__ void __launch_bounds__(kGemvThreads, 1)
    moe_route_gemv_kernel(const T* __restrict__ x, int64_t ldx, const float* __restrict__ w, int tokens, int E,
                          int H, int k, bool renormalize, float* __restrict__ logits, int32_t* __restrict__ ids,
                          float* __restrict__ weights, int32_t* __restrict__ counts, int32_t* __restrict__ offsets,
                          int32_t* __restrict__ order, int32_t* __restrict__ active, unsigned* counter) {
  __shared__ float red[kGemvWarps][kMoeRouteGemvTokens];
  __shared__ GroupSmem<kGemvThreads> smem;
  __shared__ bool is_last;
  clear_counts(smem, E);
  pdl_enter();  // x comes from the previous kernel
  router_logits_cta<T>(x, ldx, w + static_cast<int64_t>(blockIdx.x) * H, tokens, H, logits, E, red);
  if (!last_cta(counter, &is_last)) return;
  for (int t = threadIdx.x / 32; t < tokens; t += kGemvWarps)
    topk_token<EPL>(logits + static_cast<int64_t>(t) * E, E, k, renormalize, ids + t * k, weights + t * k);
  group_pairs(smem, ids, tokens, E, k, counts, offsets, order, active);  // starts with a __syncthreads
}

template <int EPL>
cudaError_t launch_topk(const float* logits, int64_t ld, int T, int E, int k, bool renormalize, int32_t* ids,
                        float* weights, cudaStream_t stream) {
  return launch_kernel(moe_topk_kernel<EPL>, dim3((T + kTopkWarps - 1) / kTopkWarps), dim3(32 * kTopkWarps), 0,
                       stream, logits, ld, T, E, k, renormalize, ids, weights);
}

template <typename T, int EPL>
cudaError_t launch_route_gemv(const void* x, int64_t ldx, const float* w, int tokens, int E, int H, int k,
                              bool renormalize, float* logits, int32_t* ids, float* weights, int32_t* counts,
                              int32_t* offsets, int32_t* order, int32_t* active, unsigned* counter,
                              cudaStream_t stream) {
  return launch_kernel(moe_route_gemv_kernel<T, EPL>, dim3(E), dim3(kGemvThreads), 0, stream,
                       static_cast<const T*>(x), ldx, w, tokens, E, H, k, renormalize, logits, ids, weights, counts,
                       offsets, order, active, counter);
}

template <typename T>
cudaError_t route_gemv_by_epl(int epl, const void* x, int64_t ldx, const float* w, int tokens, int E, int H, int k,
                              bool renormalize, float* logits, int32_t* ids, float* weights, int32_t* counts,
                              int32_t* offsets, int32_t* order, int32_t* active, unsigned* counter,
                              cudaStream_t stream) {
#define MINILLM_GEMV(N)                                                                                         \
  launch_route_gemv<T, N>(x, ldx, w, tokens, E, H, k, renormalize, logits, ids, weights, counts, offsets, order, \
                          active, counter, stream)
  return epl <= 1 ? MINILLM_GEMV(1) : epl <= 2 ? MINILLM_GEMV(2) : epl <= 4 ? MINILLM_GEMV(4)
      : epl <= 8 ? MINILLM_GEMV(8) : MINILLM_GEMV(16);
#undef MINILLM_GEMV
}

// moe.h's limits of both routing launchers.
bool route_refused(int T, int E, int k) {
  return T < 0 || E < 1 || E > kMoeMaxExperts || k < 1 || k > kMoeMaxTopK || k > E;
}

}  // namespace

cudaError_t launch_moe_route(const float* logits, int64_t ld_logits, int T, int E, int k, bool renormalize,
                             int32_t* ids, float* weights, int32_t* counts, int32_t* offsets, int32_t* order,
                             int32_t* active, cudaStream_t stream) {
  if (route_refused(T, E, k) || ld_logits < E) return cudaErrorInvalidValue;
  const int epl = (E + 31) / 32;
  cudaError_t err = cudaSuccess;
  if (T > 0) {
#define MINILLM_TOPK(N) launch_topk<N>(logits, ld_logits, T, E, k, renormalize, ids, weights, stream)
    err = epl <= 1 ? MINILLM_TOPK(1) : epl <= 2 ? MINILLM_TOPK(2) : epl <= 4 ? MINILLM_TOPK(4)
        : epl <= 8 ? MINILLM_TOPK(8) : MINILLM_TOPK(16);
#undef MINILLM_TOPK
  }
  if (err != cudaSuccess) return err;
  return launch_kernel(moe_group_kernel, dim3(1), dim3(kGroupThreads), 0, stream, ids, T, E, k, counts, offsets,
                       order, active);
}

cudaError_t launch_moe_route_gemv(const void* x, int64_t ldx, const float* router, int T, int E, int H, int k,
                                  bool renormalize, float* logits, int32_t* ids, float* weights, int32_t* counts,
                                  int32_t* offsets, int32_t* order, int32_t* active, unsigned* counter,
                                  ScalarType dtype, cudaStream_t stream) {
  const auto misaligned = [](const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes != 0; };
  if (route_refused(T, E, k) || T > kMoeRouteGemvTokens || H < 4 || H % 4 || ldx % 4 || ldx < H || misaligned(x, 8) ||
      misaligned(router, 16) || counter == nullptr)
    return cudaErrorInvalidValue;
  const int epl = (E + 31) / 32;
  if (dtype == ScalarType::kBFloat16)
    return route_gemv_by_epl<__nv_bfloat16>(epl, x, ldx, router, T, E, H, k, renormalize, logits, ids, weights,
                                            counts, offsets, order, active, counter, stream);
  if (dtype == ScalarType::kFloat16)
    return route_gemv_by_epl<__half>(epl, x, ldx, router, T, E, H, k, renormalize, logits, ids, weights, counts,
                                     offsets, order, active, counter, stream);
  return cudaErrorInvalidValue;
}

}  // namespace minillm
